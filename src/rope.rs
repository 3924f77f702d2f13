//! Rotary position embedding on the GPU (`shaders/rope.wgsl`): NeoX and GPT-J styles, any
//! `theta`, partial rotary dims, one position per token (a chunk after a cached prefix of 1,000
//! tokens passes positions `1000..`). The CPU reference and the configuration live in
//! [`mod@crate::reference::rope`]; they are re-exported here.
//!
//! The kernel writes out of place: it reads `x` and writes every element of the first
//! `n_tokens * num_heads * head_dim` of `out` (the partial-rotary tail is copied), so `x` and
//! `out` must be different buffers. Bytes of `out` past that range are never touched.
//! [`Rope::prepare_pair`] rotates two tensors of the same tokens (a decoder's queries and keys)
//! in one dispatch, with the bits of two.
//!
//! # Accuracy
//!
//! The angle is exact for every `u32` position, and no vendor `sin`/`cos` is used. The host
//! turns each pair's inverse frequency (f64, [`RopeConfig::inv_freq`]) into turns per token as a
//! 64-bit fixed-point fraction ([`turn_table`]); the kernel multiplies the position into it with
//! exact integer arithmetic (the angle modulo one turn), reduces to the nearest quarter turn,
//! and evaluates minimax polynomials on the remainder, within `pi/4` (Cephes `sinf`/`cosf`).
//! Each output differs from the f64 reference by at most `2^-20 * (|a| + |b|)` where `(a, b)`
//! is the element's input pair ([`error_bound`]; the measured error is below half of it); the
//! tail is copied bit for bit. The usual f32 formula `f32(position) * inv_freq` (Hugging Face,
//! vLLM) is off by up to `ulp(angle) / 2`, about 2e-3 radians at position 32768.

use std::num::NonZeroU64;

use crate::gpu::check_storage;
use crate::gpu::dispatch::{offset_alignment, range};
use crate::gpu::{Context, Dispatch, STORAGE};
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

pub use crate::reference::rope::{RopeConfig, RopeStyle};

crate::wgsl_struct! {
    /// Mirror of the WGSL `RopeParams` uniform.
    pub struct RopeParams {
        /// Rows (tokens * heads) in this dispatch.
        pub num_rows: u32,
        /// Heads per token.
        pub num_heads: u32,
        /// `head_dim / 2`.
        pub half_dim: u32,
        /// `rotary_dim / 2`.
        pub half_rot: u32,
        /// 0: NeoX, 1: GPT-J.
        pub style: u32,
        /// Invocations along x of the dispatch grid.
        pub stride_x: u32,
        /// Rows of the dispatch's second tensor (0: none; [`Rope::prepare_pair`]).
        pub num_rows_b: u32,
        /// Heads per token of the second tensor.
        pub num_heads_b: u32,
    }
}

/// Invocations per workgroup (the WGSL `@workgroup_size`).
const WG: u32 = 64;

/// Largest chunk one dispatch binds, whatever the adapter allows: keeps every u32 element
/// index in the kernel far from overflow.
const MAX_CHUNK_BYTES: u64 = 1 << 31;

/// Override constants for the naga tests (the kernel has none: shapes are uniform fields).
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    vec![Vec::new()]
}

/// Tolerance of the GPU result against [`crate::reference::rope::rope`] for an element whose
/// input pair is `(a, b)`: `2^-20 * (|a| + |b|)`. Derived from the kernel's arithmetic: the
/// reduced angle carries at most ~2 f32 roundings of a value within `pi/4` (<= 1.2e-7 rad),
/// each polynomial is within ~1 ulp of 1 (<= 1.2e-7), and the rotation adds three roundings
/// (<= 2^-24 each, relative to `|a| + |b|`); the sum is under 5e-7, and 2^-20 is 9.5e-7.
/// Tail elements (past `rotary_dim`) must be equal bit for bit.
pub fn error_bound(a: f32, b: f32) -> f64 {
    (f64::from(a.abs()) + f64::from(b.abs())) * 2f64.powi(-20)
}

/// The kernel's frequency table: for each pair `i < rotary_dim / 2`, the rotation per token in
/// turns modulo one, as the 64-bit fixed-point fraction
/// `round(2^64 * frac(inv_freq[i] / (2 pi)))`, split into `[low word, high word]`. The angle of
/// position `p` in turns is then `p * F / 2^64` modulo one, exactly, in 64-bit integer
/// arithmetic (which the kernel emulates with u32 words).
pub fn turn_table(cfg: &RopeConfig) -> Vec<[u32; 2]> {
    turn_table_of(&cfg.inv_freq())
}

/// [`turn_table`] of the inverse frequencies `inv_freq` (radians per position).
pub fn turn_table_of(inv_freq: &[f64]) -> Vec<[u32; 2]> {
    inv_freq
        .iter()
        .map(|&f| {
            let turns = f / std::f64::consts::TAU;
            let frac = turns - turns.floor();
            // Exact scaling by a power of two; round to the nearest unit of 2^-64 turn
            // (a value that rounds to 2^64 is a whole turn, i.e. 0).
            let fixed = (frac * 2f64.powi(64)).round() as u128 as u64;
            [fixed as u32, (fixed >> 32) as u32]
        })
        .collect()
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Tokens per dispatch: as many as one storage binding holds, in a multiple that keeps every
/// chunk's byte offset in the tensor and in the positions (4 bytes a token) aligned to
/// `min_storage_buffer_offset_alignment`.
fn tokens_per_chunk(ctx: &Context, n_tokens: usize, token_bytes: u64) -> Result<usize> {
    let limit = ctx
        .caps()
        .max_storage_buffer_binding_size
        .min(MAX_CHUNK_BYTES);
    let mut per = limit / token_bytes;
    if per == 0 {
        return Err(Error::TooLarge {
            what: "one token of the rope input".into(),
            bytes: token_bytes,
            limit,
        });
    }
    if per < n_tokens as u64 {
        let align = offset_alignment(ctx);
        // Both steps divide `align` (a power of two), so the larger is a multiple of both.
        let step = (align / gcd(token_bytes, align)).max(align / 4);
        per = per / step * step;
        if per == 0 {
            return Err(Error::TooLarge {
                what: format!("a rope chunk of {step} tokens (offsets aligned to {align} bytes)"),
                bytes: step * token_bytes,
                limit,
            });
        }
    }
    Ok(usize::try_from(per).unwrap_or(usize::MAX).min(n_tokens))
}

/// The turns table of one [`RopeConfig`] on the GPU ([`turn_table`]), uploaded once and reused
/// by every rotation with that configuration.
#[derive(Debug)]
pub struct RopeTables {
    cfg: RopeConfig,
    /// The table's words (host copy): two tables rotate in one dispatch only when these agree.
    words: Vec<u32>,
    turns: wgpu::Buffer,
}

impl RopeTables {
    /// Checks `cfg` ([`RopeConfig::validate`]) and uploads its turns table (one buffer).
    pub fn new(ctx: &Context, cfg: &RopeConfig) -> Result<Self> {
        Self::scaled(ctx, cfg, None)
    }

    /// [`RopeTables::new`] with each pair's frequency divided by its factor
    /// ([`RopeConfig::inv_freq_scaled`]: Llama 3.1's `rope_freqs.weight`); the rotation then
    /// matches [`crate::reference::rope::rope_scaled`] within [`error_bound`].
    ///
    /// # Errors
    /// The configuration's and the factors' errors ([`Error::InvalidArgument`]), before
    /// anything is uploaded; upload errors.
    pub fn scaled(ctx: &Context, cfg: &RopeConfig, factors: Option<&[f32]>) -> Result<Self> {
        cfg.validate()?;
        let inv_freq = cfg.inv_freq_scaled(factors)?;
        let turns: Vec<u32> = turn_table_of(&inv_freq).into_iter().flatten().collect();
        Ok(Self {
            cfg: *cfg,
            turns: ctx.upload("rope turns", &turns)?,
            words: turns,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RopeConfig {
        &self.cfg
    }
}

/// What one rotation reads and writes: `x` (`[tokens, num_heads, head_dim]` f32 from the start
/// of its binding) is rotated into `out` (the same shape), token `t` at position
/// `positions[t]` (u32, from the start of the buffer; rewrite it with
/// [`Context::write_buffer`] between steps).
#[derive(Debug, Clone)]
pub struct RopeArgs<'a> {
    /// The configuration's turns table.
    pub tables: &'a RopeTables,
    /// The input (a storage binding; offset aligned to `min_storage_buffer_offset_alignment`).
    pub x: wgpu::BufferBinding<'a>,
    /// Position of each token (storage, at least `tokens` u32 values).
    pub positions: &'a wgpu::Buffer,
    /// Tokens to rotate.
    pub tokens: usize,
    /// The output (as `x`, in another buffer).
    pub out: wgpu::BufferBinding<'a>,
}

/// RoPE as prepared dispatches.
#[derive(Debug, Clone, Copy)]
pub struct Rope;

/// A rotation prepared once: its parameter uniforms and bind groups are made by
/// [`Rope::prepare`]; [`encode`](Self::encode) records it and creates nothing. The positions
/// are read from the positions buffer when the work runs, so a decoder rewrites them each step
/// and records the same prepared rotation.
#[derive(Debug, Clone)]
pub struct PreparedRope {
    dispatches: Vec<Dispatch>,
}

impl PreparedRope {
    /// Records the rotation into `pass` (nothing for zero tokens).
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        for dispatch in &self.dispatches {
            dispatch.encode(pass);
        }
    }

    /// The prepared dispatches (one per chunk of tokens that fits a storage binding).
    pub fn dispatches(&self) -> &[Dispatch] {
        &self.dispatches
    }
}

/// One tensor of a dispatch: its rows, heads and chunk bindings.
struct Part<'a> {
    rows: usize,
    heads: usize,
    x: wgpu::BindingResource<'a>,
    out: wgpu::BindingResource<'a>,
}

/// Tokens `t0 .. t0 + n` of `args` (tokens of `token_bytes` bytes) as one tensor of a dispatch.
fn part<'a>(args: &RopeArgs<'a>, t0: usize, n: usize, token_bytes: u64) -> Result<Part<'a>> {
    let (offset, bytes) = (t0 as u64 * token_bytes, n as u64 * token_bytes);
    let heads = args.tables.cfg.num_heads;
    Ok(Part {
        rows: n * heads,
        heads,
        x: sub_binding(&args.x, offset, bytes)?,
        out: sub_binding(&args.out, offset, bytes)?,
    })
}

/// Everything [`Rope::prepare`] checks of `args`, before anything is made; the bytes of one
/// token.
fn check_args(ctx: &Context, args: &RopeArgs<'_>) -> Result<u64> {
    let cfg = &args.tables.cfg;
    let elems = cfg.elems(args.tokens)?;
    let bytes = elems as u64 * 4;
    let (x, out) = (&args.x, &args.out);
    check_bound(ctx, "rope input x", x, bytes)?;
    check_bound(ctx, "rope output out", out, bytes)?;
    if x.buffer == out.buffer {
        return Err(Error::InvalidArgument(
            "rope writes out of place: x and out must be different buffers".into(),
        ));
    }
    check_storage("rope positions", args.positions, args.tokens)?;
    let token_bytes = cfg.token_elems()? as u64 * 4;
    if args.tokens > 0 {
        // A token too large for one binding, refused here rather than after a first dispatch.
        tokens_per_chunk(ctx, args.tokens, token_bytes)?;
    }
    Ok(token_bytes)
}

/// `binding`'s bytes `offset .. offset + bytes` as a binding resource.
fn sub_binding<'a>(
    binding: &wgpu::BufferBinding<'a>,
    offset: u64,
    bytes: u64,
) -> Result<wgpu::BindingResource<'a>> {
    let size = NonZeroU64::new(bytes)
        .ok_or_else(|| Error::InvalidArgument("rope: an empty chunk".into()))?;
    Ok(range(binding.buffer, binding.offset + offset, size))
}

/// Whether `a` and `b` can rotate in one dispatch and give the bits of two: the same tokens,
/// positions, head size, style and turns, each within one storage binding, and no output that
/// the other tensor reads or writes (one dispatch has no order between them).
fn pairable(ctx: &Context, a: &RopeArgs<'_>, b: &RopeArgs<'_>, token_bytes: [u64; 2]) -> bool {
    let (ca, cb) = (&a.tables.cfg, &b.tables.cfg);
    let fits =
        |bytes: u64| matches!(tokens_per_chunk(ctx, a.tokens, bytes), Ok(n) if n == a.tokens);
    a.tokens == b.tokens
        && a.positions == b.positions
        && (ca.style, ca.head_dim, ca.rotary_dim) == (cb.style, cb.head_dim, cb.rotary_dim)
        && a.tables.words == b.tables.words
        && fits(token_bytes[0])
        && fits(token_bytes[1])
        && a.out.buffer != b.out.buffer
        && a.out.buffer != b.x.buffer
        && b.out.buffer != a.x.buffer
}

impl Rope {
    /// Checks `args` and makes the rotation's uniforms and bind groups (inputs larger than one
    /// storage binding are processed in chunks of whole tokens).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `x`, `out` or `positions` is smaller than the tokens need;
    /// [`Error::InvalidArgument`] when `x` and `out` are the same buffer, a buffer lacks
    /// `STORAGE` usage or a binding's offset is not aligned to
    /// `min_storage_buffer_offset_alignment`; [`Error::TooLarge`] when one token exceeds the
    /// storage binding limit; [`Error::Wgpu`] or [`Error::Shader`] from wgpu.
    pub fn prepare<'a>(ctx: &Context, args: &RopeArgs<'a>) -> Result<PreparedRope> {
        let token_bytes = check_args(ctx, args)?;
        if args.tokens == 0 {
            return Ok(PreparedRope {
                dispatches: Vec::new(),
            });
        }
        let per = tokens_per_chunk(ctx, args.tokens, token_bytes)?;
        let mut dispatches = Vec::new();
        let mut t0 = 0;
        while t0 < args.tokens {
            let n = per.min(args.tokens - t0);
            let one = part(args, t0, n, token_bytes)?;
            dispatches.push(rope_dispatch(ctx, args, (t0, n), one, None)?);
            t0 += n;
        }
        Ok(PreparedRope { dispatches })
    }

    /// Two rotations of the same tokens, `a` then `b` (a decoder's queries and keys), in one
    /// dispatch where they can share one and give the same bits as two: the same positions
    /// buffer, tokens, head size, style and turns table words, each tensor within one storage
    /// binding, and neither's output bound by the other. Otherwise the dispatches of
    /// [`Rope::prepare`] for `a` and then for `b`. Either way the results are bit-identical to
    /// two prepared rotations.
    ///
    /// # Errors
    /// [`Rope::prepare`]'s errors of `a` or of `b`, checked before anything is made.
    pub fn prepare_pair<'a>(
        ctx: &Context,
        a: &RopeArgs<'a>,
        b: &RopeArgs<'a>,
    ) -> Result<PreparedRope> {
        let (ta, tb) = (check_args(ctx, a)?, check_args(ctx, b)?);
        if a.tokens == 0 || !pairable(ctx, a, b, [ta, tb]) {
            let mut dispatches = Rope::prepare(ctx, a)?.dispatches;
            dispatches.extend(Rope::prepare(ctx, b)?.dispatches);
            return Ok(PreparedRope { dispatches });
        }
        let (first, second) = (part(a, 0, a.tokens, ta)?, part(b, 0, b.tokens, tb)?);
        Ok(PreparedRope {
            dispatches: vec![rope_dispatch(ctx, a, (0, a.tokens), first, Some(second))?],
        })
    }
}

/// One dispatch over tokens `tokens.0 .. tokens.0 + tokens.1` of `args` (its tables and
/// positions): `first`'s rows, then `second`'s where given.
fn rope_dispatch<'a>(
    ctx: &Context,
    args: &RopeArgs<'a>,
    tokens: (usize, usize),
    first: Part<'a>,
    second: Option<Part<'a>>,
) -> Result<Dispatch> {
    let cfg = &args.tables.cfg;
    let key = PipelineKey::new(ShaderVariant::new(Kernel::Rope, Precision::F32), &[]);
    let pipeline = ctx.pipeline(&key)?;
    let max_groups = ctx.caps().max_compute_workgroups_per_dimension;
    let rows_b = second.as_ref().map_or(0, |p| p.rows);
    let invocations = (first.rows + rows_b) as u64 * (cfg.head_dim / 2) as u64;
    let groups = invocations.div_ceil(u64::from(WG));
    let gx = groups.min(u64::from(max_groups)) as u32;
    let gy = groups.div_ceil(u64::from(gx));
    if gy > u64::from(max_groups) {
        return Err(Error::InvalidArgument(format!(
            "rope: {groups} workgroups exceed the adapter's {max_groups} x {max_groups} grid"
        )));
    }
    let params = RopeParams {
        num_rows: first.rows as u32,
        num_heads: first.heads as u32,
        half_dim: (cfg.head_dim / 2) as u32,
        half_rot: (cfg.rotary_dim / 2) as u32,
        style: match cfg.style {
            RopeStyle::NeoX => 0,
            RopeStyle::GptJ => 1,
        },
        stride_x: gx * WG,
        num_rows_b: rows_b as u32,
        num_heads_b: second.as_ref().map_or(0, |p| p.heads as u32),
    };
    let uniform = ctx.uniform("rope params", &params)?;
    let positions = sub_binding(
        &args.positions.as_entire_buffer_binding(),
        tokens.0 as u64 * 4,
        tokens.1 as u64 * 4,
    )?;
    // A dispatch of one tensor binds its x and out again as the (unread) second.
    let (x_b, out_b) = match second {
        Some(p) => (p.x, p.out),
        None => (first.x.clone(), first.out.clone()),
    };
    ctx.prepare_dispatch(
        "rope",
        &pipeline,
        &[
            uniform.as_entire_binding(),
            first.x,
            positions,
            args.tables.turns.as_entire_binding(),
            first.out,
            x_b,
            out_b,
        ],
        [gx, gy as u32, 1],
    )
}

/// Checks that `binding` lies inside its buffer at an aligned offset, has `STORAGE` usage and
/// holds `bytes` bytes (it may exceed one storage binding: it is bound in chunks).
fn check_bound(
    ctx: &Context,
    what: &'static str,
    binding: &wgpu::BufferBinding<'_>,
    bytes: u64,
) -> Result<()> {
    let size = crate::gpu::dispatch::check_binding_place(ctx, what, binding)?;
    if size < bytes {
        return Err(Error::ShapeMismatch {
            what,
            expected: usize::try_from(bytes / 4).unwrap_or(usize::MAX),
            got: usize::try_from(size / 4).unwrap_or(usize::MAX),
        });
    }
    Ok(())
}

/// Records the rotation of `args` into `pass`: [`Rope::prepare`], then
/// [`PreparedRope::encode`] (bind groups made by this call; keep a [`PreparedRope`] to record
/// warm steps without creating anything).
///
/// # Errors
/// As [`Rope::prepare`]; nothing is recorded on error.
pub fn encode_rope(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    args: &RopeArgs<'_>,
) -> Result<()> {
    Rope::prepare(ctx, args)?.encode(pass);
    Ok(())
}

/// Rotates `x` (`[positions.len(), num_heads, head_dim]` f32, row-major, at the start of the
/// buffer) into `out`, token `t` at position `positions[t]`. One submission; inputs larger
/// than one storage binding are processed in chunks of whole tokens. Uploads the turns table
/// and the positions each call: a decoder keeps a [`RopeTables`], a positions buffer and a
/// [`PreparedRope`] instead.
///
/// # Errors
/// Everything is checked before anything is dispatched, and on error nothing is written:
/// the configuration ([`RopeConfig::validate`]); [`Error::ShapeMismatch`] when `x` or `out` is
/// smaller than the tensor; [`Error::InvalidArgument`] when `x` and `out` are the same buffer
/// or either lacks `STORAGE` usage; [`Error::TooLarge`] when one token exceeds the storage
/// binding limit; [`Error::Wgpu`] or [`Error::Shader`] from wgpu.
pub fn rope(
    ctx: &Context,
    cfg: &RopeConfig,
    x: &wgpu::Buffer,
    positions: &[u32],
    out: &wgpu::Buffer,
) -> Result<()> {
    cfg.validate()?;
    let elems = cfg.elems(positions.len())?;
    check_storage("rope input buffer x", x, elems)?;
    check_storage("rope output buffer out", out, elems)?;
    if x == out {
        return Err(Error::InvalidArgument(
            "rope writes out of place: x and out must be different buffers".into(),
        ));
    }
    if positions.is_empty() {
        return Ok(());
    }
    // Chunks bind at most one binding's worth of tokens; the whole tensor must fit the
    // buffer-size limit only.
    let tables = RopeTables::new(ctx, cfg)?;
    let positions_buffer = ctx.upload("rope positions", positions)?;
    let prepared = Rope::prepare(
        ctx,
        &RopeArgs {
            tables: &tables,
            x: x.as_entire_buffer_binding(),
            positions: &positions_buffer,
            tokens: positions.len(),
            out: out.as_entire_buffer_binding(),
        },
    )?;
    ctx.run_pass("rope", |pass| {
        prepared.encode(pass);
        Ok(())
    })?;
    Ok(())
}

/// A storage buffer holding `data`, sized by the adapter's buffer limit rather than its binding
/// limit ([`rope`] binds it in chunks).
fn storage_buffer(ctx: &Context, label: &str, data: &[f32]) -> Result<wgpu::Buffer> {
    let bytes = data.len() as u64 * 4;
    let limit = ctx.caps().max_buffer_size;
    if bytes > limit {
        return Err(Error::TooLarge {
            what: format!("buffer {label}"),
            bytes,
            limit,
        });
    }
    // Created and filled under error scopes: out of memory or a lost device is a typed error.
    ctx.buffer_with(label, bytemuck::cast_slice(data), 16, STORAGE)
}

/// [`rope`] on host data: uploads `x` (`[positions.len(), num_heads, head_dim]`), rotates it
/// into an output pre-filled with NaN (so a missing write shows) and reads the result back.
///
/// # Errors
/// As [`rope`], and [`Error::ShapeMismatch`] when `x` does not hold exactly
/// `positions.len() * num_heads * head_dim` values.
pub fn rope_host(
    ctx: &Context,
    cfg: &RopeConfig,
    x: &[f32],
    positions: &[u32],
) -> Result<Vec<f32>> {
    cfg.validate()?;
    let elems = cfg.elems(positions.len())?;
    if x.len() != elems {
        return Err(Error::ShapeMismatch {
            what: "rope input x",
            expected: elems,
            got: x.len(),
        });
    }
    if elems == 0 {
        return Ok(Vec::new());
    }
    let input = storage_buffer(ctx, "rope x", x)?;
    let out = storage_buffer(ctx, "rope out", &vec![crate::gpu::UNWRITTEN; elems])?;
    rope(ctx, cfg, &input, positions, &out)?;
    ctx.read_back(&out, elems)
}

#[cfg(test)]
mod tests {
    //! The kernel's arithmetic emulated on the CPU in f32 (Rust never contracts to FMA), checked
    //! against f64: the accuracy claim of the module docs, without a GPU.

    use super::*;

    fn mul_hi_u32(a: u32, b: u32) -> u32 {
        ((u64::from(a) * u64::from(b)) >> 32) as u32
    }

    /// `shaders/rope.wgsl`'s `sin_cos_turns`, operation for operation.
    fn sin_cos_turns(position: u32, f: [u32; 2]) -> (f32, f32) {
        let hi = position
            .wrapping_mul(f[1])
            .wrapping_add(mul_hi_u32(position, f[0]));
        let lo = position.wrapping_mul(f[0]);
        let shifted = hi.wrapping_add(0x2000_0000);
        let q = shifted >> 30;
        let rem = (shifted & 0x3fff_ffff) as i32 - 0x2000_0000;
        let hi_unit = (std::f64::consts::TAU / 2f64.powi(32)) as f32;
        let lo_unit = (std::f64::consts::TAU / 2f64.powi(64)) as f32;
        let r = rem as f32 * hi_unit + lo as f32 * lo_unit;
        let z = r * r;
        let s = ((-1.951_529_6e-4 * z + 8.332_161e-3) * z - 1.666_665_5e-1) * z * r + r;
        let c =
            ((2.443_315_7e-5 * z - 1.388_731_6e-3) * z + 4.166_664_6e-2) * z * z - 0.5 * z + 1.0;
        let odd = q & 1 == 1;
        let (mut sn, mut cs) = if odd { (c, s) } else { (s, c) };
        if q >= 2 {
            sn = -sn;
        }
        if q == 1 || q == 2 {
            cs = -cs;
        }
        (sn, cs)
    }

    fn positions() -> Vec<u32> {
        let mut p: Vec<u32> = (0..3000).collect();
        p.extend((0..2000).map(|i| 32768 + i * 7919 % 40000));
        p.extend([(1 << 20) - 1, 1 << 20, 1_000_003]);
        p
    }

    #[test]
    fn mul_hi_from_halves_matches_64_bit_product() {
        // The WGSL version, in Rust.
        fn halves(a: u32, b: u32) -> u32 {
            let (a0, a1, b0, b1) = (a & 0xffff, a >> 16, b & 0xffff, b >> 16);
            let (p00, p01, p10, p11) = (a0 * b0, a0 * b1, a1 * b0, a1 * b1);
            let mid = (p00 >> 16) + (p01 & 0xffff) + (p10 & 0xffff);
            p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)
        }
        let vals = [
            0,
            1,
            2,
            0xffff,
            0x10000,
            0x1234_5678,
            0x8000_0000,
            u32::MAX - 1,
            u32::MAX,
        ];
        for a in vals {
            for b in vals {
                assert_eq!(halves(a, b), mul_hi_u32(a, b), "{a:#x} * {b:#x}");
            }
        }
    }

    #[test]
    fn sin_cos_is_accurate_for_every_position_size() {
        let mut worst: f64 = 0.0;
        for theta in [1.0e4f32, 5.0e5, 0.4] {
            let cfg = RopeConfig::new(RopeStyle::NeoX, theta, 128, 1);
            let inv = cfg.inv_freq();
            for (i, f) in turn_table(&cfg).into_iter().enumerate() {
                for p in positions() {
                    let (s, c) = sin_cos_turns(p, f);
                    let (ws, wc) = (f64::from(p) * inv[i]).sin_cos();
                    worst = worst
                        .max((f64::from(s) - ws).abs())
                        .max((f64::from(c) - wc).abs());
                }
            }
        }
        // About 1.5 ulp of 1; the bound in `error_bound` assumes <= 1.2e-7 from the trig
        // values plus <= 1.2e-7 from the angle.
        eprintln!("emulated sin/cos: worst error {worst:e}");
        assert!(worst < 1.8e-7, "worst sin/cos error {worst:e}");
    }

    #[test]
    fn huge_positions_reduce_exactly() {
        // Whole turns: a pair whose table entry is exactly 1/4 turn per token.
        let quarter = [0u32, 0x4000_0000];
        for (p, want) in [
            (0u32, (0.0, 1.0)),
            (1, (1.0, 0.0)),
            (2, (0.0, -1.0)),
            (3, (-1.0, 0.0)),
        ] {
            for big in [0u32, 4 << 20, 4_000_000_000] {
                let (s, c) = sin_cos_turns(p + big, quarter);
                assert!(
                    (s - want.0).abs() < 1e-7 && (c - want.1).abs() < 1e-7,
                    "{p}+{big}"
                );
            }
        }
        // Against the exact fixed-point angle (not f64's `p * inv_freq`, which loses digits).
        let cfg = RopeConfig::new(RopeStyle::GptJ, 10000.0, 64, 1);
        for f in turn_table(&cfg) {
            let fixed = u64::from(f[0]) | u64::from(f[1]) << 32;
            for p in [u32::MAX, 3_000_000_000, 123_456_789] {
                let turns = u64::from(p).wrapping_mul(fixed) as f64 / 2f64.powi(64);
                let (ws, wc) = (turns * std::f64::consts::TAU).sin_cos();
                let (s, c) = sin_cos_turns(p, f);
                assert!((f64::from(s) - ws).abs() < 1.8e-7, "sin at {p}");
                assert!((f64::from(c) - wc).abs() < 1.8e-7, "cos at {p}");
            }
        }
    }

    #[test]
    fn emulated_kernel_is_within_the_error_bound() {
        let mut worst: f64 = 0.0;
        let mut seed = 0x1234_5678_9abc_def0u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 11) as f64 / (1u64 << 53) as f64 * 8.0 - 4.0) as f32
        };
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            let cfg = RopeConfig::new(style, 10000.0, 64, 1);
            let table = turn_table(&cfg);
            let inv = cfg.inv_freq();
            for p in positions() {
                for (i, &f) in table.iter().enumerate() {
                    let (a, b) = (next(), next());
                    let (s, c) = sin_cos_turns(p, f);
                    let (ga, gb) = (a * c - b * s, a * s + b * c);
                    let (ws, wc) = (f64::from(p) * inv[i]).sin_cos();
                    let (a64, b64) = (f64::from(a), f64::from(b));
                    let (wa, wb) = ((a64 * wc - b64 * ws) as f32, (a64 * ws + b64 * wc) as f32);
                    for (g, w) in [(ga, wa), (gb, wb)] {
                        let err = (f64::from(g) - f64::from(w)).abs();
                        assert!(err <= error_bound(a, b), "{style:?} p {p} pair {i}");
                        worst = worst.max(err / error_bound(a, b));
                    }
                }
            }
        }
        eprintln!("emulated rope: worst error / bound {worst}");
        assert!(worst < 0.6, "worst error / bound {worst}");
    }

    #[test]
    fn turn_table_matches_the_frequencies() {
        let cfg = RopeConfig::new(RopeStyle::NeoX, 500000.0, 128, 1);
        for (f, inv) in turn_table(&cfg).into_iter().zip(cfg.inv_freq()) {
            let fixed = u64::from(f[0]) | u64::from(f[1]) << 32;
            let rad = fixed as f64 / 2f64.powi(64) * std::f64::consts::TAU;
            assert!((rad - inv).abs() <= 1e-15 * inv.max(1e-3), "{rad} vs {inv}");
        }
    }
}
