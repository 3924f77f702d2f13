//! WGSL sources, composed by concatenation from `shaders/lib/` pieces and one kernel file.
//!
//! This module knows kernels by name and source only: it imports no kernel module. Each kernel
//! module declares its own parameter structs and override constants, and
//! [`kernels`](crate::kernels) assembles the list of every variant above them (the naga tests
//! walk it).
//!
//! There is no preprocessor: a variant is a precision prelude (type aliases, and `enable f16;`
//! for the f16 path), the library pieces the kernel needs, then the kernel itself. Everything
//! else is specialized with WGSL `override` constants when the pipeline is created.

// The one kernel type this module still names: the lanes kernel's written-out shape (its
// `body()` is the composed source). It lives in `attention::paged_lanes`, which imports nothing
// of this module; moving it here would untangle the last edge (see `kernels`).
use crate::attention::paged_lanes::LanesShape;

/// Precision prelude of the portable variants.
const PRELUDE_F32: &str = include_str!("../shaders/lib/precision_f32.wgsl");
/// Precision prelude of the f16 variants (needs `SHADER_F16`).
const PRELUDE_F16: &str = include_str!("../shaders/lib/precision_f16.wgsl");
/// KV storage formats: dtype codes, row sizes, exact decoders of single values.
const LIB_KV_FORMAT: &str = include_str!("../shaders/lib/kv_format.wgsl");
/// Values of weights in GGUF block formats (the decoder's quantized products).
pub(crate) const LIB_GGML_BLOCKS: &str = include_str!("../shaders/lib/ggml_blocks.wgsl");
const LIB_QMATMUL_DOT: &str = include_str!("../shaders/lib/qmatmul_dot.wgsl");
/// Reading K/V rows of any storage format through the kernel's pool accessors.
const LIB_KV_LOAD: &str = include_str!("../shaders/lib/kv_load.wgsl");
/// KV encoding for the storage formats (append).
const LIB_KV_STORE: &str = include_str!("../shaders/lib/kv_store.wgsl");
/// The paged kernel's per-row reductions and entry point, core WGSL.
const LIB_ROWS_PORTABLE: &str = include_str!("../shaders/lib/rows_portable.wgsl");
/// The same with subgroup operations (needs `SUBGROUP`).
const LIB_ROWS_SUBGROUP: &str = include_str!("../shaders/lib/rows_subgroup.wgsl");
/// Decoding 16-byte chunks of K/V rows of any format (the paged attention kernels).
const LIB_KV_CHUNK: &str = include_str!("../shaders/lib/kv_chunk.wgsl");
/// `kv_half2` by the exact integer decoder, or by `unpack2x16float` (checked exact).
const LIB_HALF2_EXACT: &str = include_str!("../shaders/lib/half2_exact.wgsl");
const LIB_HALF2_CONVERT: &str = include_str!("../shaders/lib/half2_convert.wgsl");
/// The paged attention kernels' parameters, bindings and pool accessors.
const LIB_PAGED_IO: &str = include_str!("../shaders/lib/paged_io.wgsl");
/// Shared constants and online-softmax helpers.
const LIB_SOFTMAX: &str = include_str!("../shaders/lib/softmax.wgsl");

/// In which precision a kernel variant keeps its values. Accumulation is f32 in both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum Precision {
    /// Portable: core WGSL only, every value in f32.
    F32,
    /// Q, K, V and probabilities held in f16 (needs `SHADER_F16`); products and sums in f32.
    F16,
}

impl Precision {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16 => "f16",
        }
    }
}

/// A kernel family: one WGSL file in `shaders/` and the Rust module that dispatches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kernel {
    /// Attention over a paged (or contiguous) KV cache, decode and prefill
    /// (`shaders/paged.wgsl`).
    Paged,
    /// The same attention for CPU-backed adapters, one (work item, KV head) per invocation
    /// (`shaders/paged_lanes.wgsl`).
    PagedLanes,
    /// Merge of split-K partial states (`shaders/merge.wgsl`).
    Merge,
    /// Merge of two attention states, for cascade attention (`shaders/merge_states.wgsl`).
    MergeStates,
    /// Dequantize KV rows of any storage format to f32 (`shaders/dequant.wgsl`).
    Dequant,
    /// Write new K/V rows into their pool slots (`shaders/append_kv.wgsl`).
    AppendKv,
    /// Copy whole blocks inside a pool buffer (`shaders/copy_blocks.wgsl`).
    CopyBlocks,
    /// Rotary position embedding at per-token positions (`shaders/rope.wgsl`).
    Rope,
    /// Strided per-head batched matrix product, for MLA (`shaders/head_matmul.wgsl`).
    HeadMatmul,
    /// Strided bit-exact copy of `[rows, heads, n]` blocks, for MLA
    /// (`shaders/strided_copy.wgsl`).
    StridedCopy,
    /// Llama RMSNorm, one workgroup per row (`shaders/rms_norm.wgsl`).
    RmsNorm,
    /// `silu(gate) * up` (`shaders/swiglu.wgsl`).
    Swiglu,
    /// In-place residual add `x += y` (`shaders/add.wgsl`).
    Add,
    /// Token-embedding gather (`shaders/embed.wgsl`).
    Embed,
    /// Matrix product over weights in a GGUF block format, the lane kernel
    /// (`shaders/qmatmul.wgsl`).
    QMatmul,
    /// The same product, the row kernel for CPU adapters (`shaders/qmatmul_rows.wgsl`).
    QMatmulRows,
    /// The same product, tiled through workgroup memory for many rows
    /// (`shaders/qmatmul_tiled.wgsl`).
    QMatmulTiled,
    /// Token-embedding gather from a table in a GGUF block format (`shaders/qembed.wgsl`).
    QEmbed,
    /// The copy kernel measuring memory bandwidth (`shaders/bandwidth.wgsl`).
    Bandwidth,
    /// Independent FMA chains measuring the arithmetic rate (`shaders/fma_rate.wgsl`).
    FmaRate,
    /// Every f16 pattern through `unpack2x16float`, checked on the host before kernels use it
    /// (`shaders/f16_check.wgsl`).
    F16Check,
}

impl Kernel {
    /// Every kernel family.
    pub const ALL: [Kernel; 21] = [
        Kernel::Paged,
        Kernel::PagedLanes,
        Kernel::Merge,
        Kernel::MergeStates,
        Kernel::Dequant,
        Kernel::AppendKv,
        Kernel::CopyBlocks,
        Kernel::Rope,
        Kernel::HeadMatmul,
        Kernel::StridedCopy,
        Kernel::RmsNorm,
        Kernel::Swiglu,
        Kernel::Add,
        Kernel::Embed,
        Kernel::QMatmul,
        Kernel::QMatmulRows,
        Kernel::QMatmulTiled,
        Kernel::QEmbed,
        Kernel::Bandwidth,
        Kernel::FmaRate,
        Kernel::F16Check,
    ];

    /// Name used in labels, errors and pipeline keys.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Paged => "paged",
            Kernel::PagedLanes => "paged_lanes",
            Kernel::Merge => "merge",
            Kernel::MergeStates => "merge_states",
            Kernel::Dequant => "dequant",
            Kernel::AppendKv => "append_kv",
            Kernel::CopyBlocks => "copy_blocks",
            Kernel::Rope => "rope",
            Kernel::HeadMatmul => "head_matmul",
            Kernel::StridedCopy => "strided_copy",
            Kernel::RmsNorm => "rms_norm",
            Kernel::Swiglu => "swiglu",
            Kernel::Add => "add",
            Kernel::Embed => "embed",
            Kernel::QMatmul => "qmatmul",
            Kernel::QMatmulRows => "qmatmul_rows",
            Kernel::QMatmulTiled => "qmatmul_tiled",
            Kernel::QEmbed => "qembed",
            Kernel::Bandwidth => "bandwidth",
            Kernel::FmaRate => "fma_rate",
            Kernel::F16Check => "f16_check",
        }
    }

    fn body(self) -> &'static str {
        match self {
            // Written out per shape by ShaderVariant::source; the template alone.
            Kernel::PagedLanes => include_str!("../shaders/paged_lanes.wgsl"),
            Kernel::Paged => include_str!("../shaders/paged.wgsl"),
            Kernel::Merge => include_str!("../shaders/merge.wgsl"),
            Kernel::MergeStates => include_str!("../shaders/merge_states.wgsl"),
            Kernel::Dequant => include_str!("../shaders/dequant.wgsl"),
            Kernel::AppendKv => include_str!("../shaders/append_kv.wgsl"),
            Kernel::CopyBlocks => include_str!("../shaders/copy_blocks.wgsl"),
            Kernel::Rope => include_str!("../shaders/rope.wgsl"),
            Kernel::HeadMatmul => include_str!("../shaders/head_matmul.wgsl"),
            Kernel::StridedCopy => include_str!("../shaders/strided_copy.wgsl"),
            Kernel::RmsNorm => include_str!("../shaders/rms_norm.wgsl"),
            Kernel::Swiglu => include_str!("../shaders/swiglu.wgsl"),
            Kernel::Add => include_str!("../shaders/add.wgsl"),
            Kernel::Embed => include_str!("../shaders/embed.wgsl"),
            Kernel::QMatmul => include_str!("../shaders/qmatmul.wgsl"),
            Kernel::QMatmulRows => include_str!("../shaders/qmatmul_rows.wgsl"),
            Kernel::QMatmulTiled => include_str!("../shaders/qmatmul_tiled.wgsl"),
            Kernel::QEmbed => include_str!("../shaders/qembed.wgsl"),
            Kernel::Bandwidth => include_str!("../shaders/bandwidth.wgsl"),
            Kernel::FmaRate => include_str!("../shaders/fma_rate.wgsl"),
            Kernel::F16Check => include_str!("../shaders/f16_check.wgsl"),
        }
    }

    fn libs(self) -> &'static [&'static str] {
        match self {
            Kernel::Paged | Kernel::PagedLanes => &[
                LIB_KV_FORMAT,
                LIB_KV_LOAD,
                LIB_KV_CHUNK,
                LIB_SOFTMAX,
                LIB_PAGED_IO,
            ],
            Kernel::Merge | Kernel::MergeStates => &[LIB_SOFTMAX],
            Kernel::Dequant => &[LIB_KV_FORMAT, LIB_KV_LOAD],
            Kernel::QMatmul | Kernel::QMatmulRows | Kernel::QMatmulTiled => {
                &[LIB_KV_FORMAT, LIB_GGML_BLOCKS, LIB_QMATMUL_DOT]
            }
            Kernel::QEmbed => &[LIB_KV_FORMAT, LIB_GGML_BLOCKS],
            Kernel::AppendKv => &[LIB_KV_FORMAT, LIB_KV_STORE],
            Kernel::CopyBlocks => &[],
            Kernel::Rope => &[],
            Kernel::HeadMatmul | Kernel::StridedCopy => &[],
            Kernel::RmsNorm | Kernel::Swiglu | Kernel::Add | Kernel::Embed => &[],
            Kernel::Bandwidth | Kernel::FmaRate | Kernel::F16Check => &[],
        }
    }

    /// Whether the kernel also comes with subgroup reductions (the paged attention kernel).
    pub fn has_subgroup_variant(self) -> bool {
        self == Kernel::Paged
    }

    /// The precisions this kernel is built in.
    pub fn precisions(self) -> &'static [Precision] {
        match self {
            Kernel::Paged | Kernel::PagedLanes | Kernel::FmaRate => {
                &[Precision::F32, Precision::F16]
            }
            Kernel::Merge
            | Kernel::MergeStates
            | Kernel::Dequant
            | Kernel::AppendKv
            | Kernel::CopyBlocks
            | Kernel::Rope
            | Kernel::HeadMatmul
            | Kernel::StridedCopy
            | Kernel::RmsNorm
            | Kernel::Swiglu
            | Kernel::Add
            | Kernel::Embed
            | Kernel::QMatmul
            | Kernel::QMatmulRows
            | Kernel::QMatmulTiled
            | Kernel::QEmbed
            | Kernel::Bandwidth
            | Kernel::F16Check => &[Precision::F32],
        }
    }
}

/// The shape the workgroup attention kernel ([`Kernel::Paged`]) is written out for: the bounds
/// of its `@unroll` loops (rows per tile; chunks per lane and vec4 columns per chunk of a K row,
/// an MLA RoPE key and a value row). The override constants of the same names must agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PagedShape {
    /// `TILE`.
    pub tile: u8,
    /// `CHK` and `QK`.
    pub k: (u8, u8),
    /// `CHR` and `QR`.
    pub rope: (u8, u8),
    /// `CHV` and `QV`.
    pub v: (u8, u8),
}

impl PagedShape {
    /// `t4 k2x2 r0x2 v2x2` (for shader names).
    pub fn name(&self) -> String {
        format!(
            "t{} k{}x{} r{}x{} v{}x{}",
            self.tile, self.k.0, self.k.1, self.rope.0, self.rope.1, self.v.0, self.v.1
        )
    }

    /// The sizes of the kernel's private arrays for this shape, by constant name: the query
    /// and accumulator vec4s of one invocation and its chunks of a K or value row (in the loop form,
    /// `shaders/paged.wgsl` declares the largest any shape may take). Larger private arrays
    /// than a shape reads cost some compilers (lavapipe's among them) time and registers.
    fn array_sizes(&self) -> [(&'static str, u32); 3] {
        let (t, k, r, v) = (
            u32::from(self.tile),
            u32::from(self.k.0) * u32::from(self.k.1),
            u32::from(self.rope.0) * u32::from(self.rope.1),
            u32::from(self.v.0) * u32::from(self.v.1),
        );
        [
            ("MAX_QREG", (t * (k + r)).max(1)),
            ("MAX_AREG", (t * v).max(1)),
            // The value loop reads the K chunks again where the values are the K row (MLA).
            ("MAX_CHK", u32::from(self.k.0.max(self.v.0)).max(1)),
        ]
    }

    /// The bounds of the `@unroll` loops by name.
    fn bounds(&self) -> [(&'static str, u32); 9] {
        [
            ("PAIR", 2),
            ("TILE", u32::from(self.tile)),
            ("ROW_QUADS", u32::from(self.tile).div_ceil(4)),
            ("CHK", u32::from(self.k.0)),
            ("QK", u32::from(self.k.1)),
            ("CHR", u32::from(self.rope.0)),
            ("QR", u32::from(self.rope.1)),
            ("CHV", u32::from(self.v.0)),
            ("QV", u32::from(self.v.1)),
        ]
    }
}

/// `src` with every loop `for (var x = 0u; x < BOUND; x++) { // @unroll` whose BOUND is named
/// in `bounds` written out: one block per value, each declaring `const x = <value>u;`. Loops of
/// other bounds stay. The loop's body must not `break` or `continue`.
pub fn unroll(src: &str, bounds: &[(&str, u32)]) -> String {
    let lines: Vec<&str> = src.lines().collect();
    let mut out = String::with_capacity(src.len() * 4);
    unroll_lines(&lines, bounds, &mut out);
    out
}

/// The loop variable and bound of an `@unroll` loop header.
fn unroll_header(line: &str) -> Option<(&str, &str)> {
    let code = line.strip_suffix("// @unroll")?.trim();
    let rest = code.strip_prefix("for (var ")?.strip_suffix(") {")?;
    let (var, rest) = rest.split_once(" = 0u; ")?;
    let (lhs, rest) = rest.split_once(" < ")?;
    let (bound, step) = rest.split_once("; ")?;
    (lhs == var && step == format!("{var}++")).then_some((var, bound))
}

/// `src` with each line `const NAME: u32 = <value>u;` whose NAME is in `sizes` given that
/// size instead. Other lines stay.
pub fn size_constants(src: &str, sizes: &[(&str, u32)]) -> String {
    let mut out = String::with_capacity(src.len());
    for line in src.lines() {
        let size = line
            .strip_prefix("const ")
            .and_then(|rest| rest.split_once(": u32 = "))
            .and_then(|(name, _)| sizes.iter().find(|s| s.0 == name));
        match size {
            Some((name, n)) => out.push_str(&format!("const {name}: u32 = {n}u;")),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Net `{` minus `}` of a line, comments left out.
fn brace_depth(line: &str) -> i64 {
    let code = line.split("//").next().unwrap_or("");
    code.matches('{').count() as i64 - code.matches('}').count() as i64
}

fn unroll_lines(lines: &[&str], bounds: &[(&str, u32)], out: &mut String) {
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let header = unroll_header(line.trim_end())
            .and_then(|(var, bound)| Some((var, bounds.iter().find(|b| b.0 == bound)?.1)));
        let Some((var, n)) = header else {
            out.push_str(line);
            out.push('\n');
            i += 1;
            continue;
        };
        // The loop's closing line: where the braces opened by the header close.
        let mut depth = brace_depth(line);
        let mut end = i + 1;
        while end < lines.len() {
            depth += brace_depth(lines[end]);
            if depth <= 0 {
                break;
            }
            end += 1;
        }
        let indent = &line[..line.len() - line.trim_start().len()];
        let body = &lines[i + 1..end.min(lines.len())];
        for k in 0..n {
            out.push_str(&format!("{indent}{{\n{indent}    const {var} = {k}u;\n"));
            unroll_lines(body, bounds, out);
            out.push_str(&format!("{indent}}}\n"));
        }
        i = end + 1;
    }
}

/// The line of `shaders/paged.wgsl` and `shaders/paged_lanes.wgsl` that [`pool_bindings`]
/// replaces.
pub const POOL_BINDINGS_MARK: &str = "// @pool-bindings";

/// The binding numbers of the K and V views of pool slot `slot`: 2 and 3 for slot 0, then 9
/// and 10, 11 and 12, ... (bindings 4 to 8 are the attention kernels' others). A kernel with a
/// second kind of view of its `slots` slots numbers them as slots `slots ..` of the first.
pub fn pool_binding_numbers(slot: u32) -> (u32, u32) {
    if slot == 0 {
        (2, 3)
    } else {
        (7 + 2 * slot, 8 + 2 * slot)
    }
}

/// The attention kernels' pool declarations for `slots` bound pool buffers (K and V each) and
/// the constant `POOL_SLOTS`. Pool `which` = 2 slot + (0 for K, 1 for V). Without `words` (the
/// workgroup kernel): `array<vec4<u32>>` views (`k_pool4_s`, `v_pool4_s`, numbered by
/// [`pool_binding_numbers`]) and `pool_vec4(which, i)`. With `words` (the lanes kernel):
/// `array<u32>` views in those numbers and `pool_word(which, i)`, then the vec4 views of the same
/// buffers after them (a module that never reads them leaves them out of its layout, and the
/// host binds them only for shapes that read them). WGSL cannot index a list of bindings, and
/// a binding a kernel reads is part of its pipeline's layout, so each slot count is its own
/// written-out source.
pub fn pool_bindings(slots: u32, words: bool) -> String {
    let slots = slots.max(1);
    let mut src = format!("const POOL_SLOTS: u32 = {slots}u;\n");
    // The views `suffix` of type `ty`, numbered from binding slot `first`.
    let declare = |src: &mut String, suffix: &str, ty: &str, first: u32| {
        for s in 0..slots {
            let (k, v) = pool_binding_numbers(first + s);
            src.push_str(&format!(
                "@group(0) @binding({k}) var<storage, read> k_pool{suffix}_{s}: array<{ty}>;\n\
                 @group(0) @binding({v}) var<storage, read> v_pool{suffix}_{s}: array<{ty}>;\n"
            ));
        }
    };
    let accessor = |src: &mut String, name: &str, suffix: &str, ty: &str| {
        src.push_str(&format!(
            "\nfn {name}(which: u32, i: u32) -> {ty} {{\n    switch which {{\n"
        ));
        for s in 0..slots {
            for (kv, pool) in ["k", "v"].iter().enumerate() {
                let which = 2 * s + kv as u32;
                let case = if which == 2 * slots - 1 {
                    "default".to_string()
                } else {
                    format!("case {which}u")
                };
                src.push_str(&format!(
                    "        {case}: {{\n            return {pool}_pool{suffix}_{s}[i];\n        }}\n"
                ));
            }
        }
        src.push_str("    }\n}\n");
    };
    if words {
        declare(&mut src, "", "u32", 0);
        declare(&mut src, "4", "vec4<u32>", slots);
        accessor(&mut src, "pool_word", "", "u32");
    } else {
        declare(&mut src, "4", "vec4<u32>", 0);
    }
    accessor(&mut src, "pool_vec4", "4", "vec4<u32>");
    src
}

/// The line of `shaders/qmatmul_rows.wgsl` that [`window_source`] replaces with the weight
/// windows' declarations and their reader `ggml_word`.
pub const WINDOW_BINDINGS_MARK: &str = "// @window-bindings";

/// The line of `shaders/qmatmul_rows.wgsl` that [`window_source`] replaces with the quads of
/// windows after the first (windows 4 to 7, and 8 to 11) where the variant binds them.
pub const LATER_QUADS_MARK: &str = "// @later-quads";

/// The row kernel of the block-format product written out for `windows` bound windows of the
/// weight (4, 8 or 12: a whole number of quads of 4; 0 reads as 4): bindings `w` (2) and `w1`
/// .. (6 ..; 3 to 5 are the outputs), `ggml_word` reading word `i` of window `win` through a
/// `switch` over them, and the later quads' sums. Each count is its own source because a CPU adapter's compiler copies
/// every case of the switch into every read before it folds `win` to a constant: compiling the
/// 8-window form for a dispatch of 4 or fewer windows took 2 to 3 times as long on lavapipe.
pub fn window_source(body: &str, windows: u8) -> String {
    let quads = windows.div_ceil(4).clamp(1, 3);
    let windows = 4 * quads;
    let mut decl = String::new();
    let mut cases = String::new();
    for j in 1..windows {
        decl.push_str(&format!(
            "@group(0) @binding({}) var<uniform> w{j}: array<vec4<u32>, X_VEC4>;\n",
            5 + j
        ));
        cases.push_str(&format!(
            "        case {j}u: {{\n            return w{j}[at / 4u][at % 4u];\n        }}\n"
        ));
    }
    let reader = format!(
        "\nfn ggml_word(i: u32) -> u32 {{\n    let at = params.win_w_base[win / 4u][win % 4u] + i;\n    \
         switch win {{\n{cases}        default: {{\n            return w[at / 4u][at % 4u];\n        \
         }}\n    }}\n}}\n"
    );
    let later: String = (1..quads)
        .map(|q| {
            format!(
                "            quad_store(t, o0, {f}u, quad_sums(o0, chunks, t, {f}u));\n",
                f = 4 * q
            )
        })
        .collect();
    body.replace(WINDOW_BINDINGS_MARK, &(decl + &reader))
        .replace(LATER_QUADS_MARK, &later)
}

/// One composable shader: a kernel in a precision, with portable or subgroup reductions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShaderVariant {
    /// The kernel family.
    pub kernel: Kernel,
    /// The precision prelude.
    pub precision: Precision,
    /// Reductions with subgroup operations (needs `SUBGROUP`; kernels with
    /// [`Kernel::has_subgroup_variant`] only).
    pub subgroups: bool,
    /// The shape the lanes attention kernel is written out for ([`Kernel::PagedLanes`] only).
    pub lanes: Option<LanesShape>,
    /// The shape the workgroup attention kernel is written out for ([`Kernel::Paged`] only;
    /// `None` keeps its loops).
    pub unroll: Option<PagedShape>,
    /// f16 values are converted with `unpack2x16float` ([`Kernel::Paged`] and the
    /// block-format kernels, [`Kernel::QMatmul`], [`Kernel::QMatmulRows`],
    /// [`Kernel::QMatmulTiled`] and [`Kernel::QEmbed`]; needs
    /// [`wgpu::DownlevelFlags::SHADER_F16_IN_F32`] and a passed f16 check,
    /// [`Capabilities::f16_unpack_exact`](crate::gpu::Capabilities::f16_unpack_exact)).
    pub f16_convert: bool,
    /// Pool buffers (K and V each) the workgroup attention kernel binds, at least 1
    /// ([`Kernel::Paged`] only; [`pool_bindings`] writes their declarations).
    pub pool_slots: u8,
    /// Windows of the weight the row kernel of the block-format product binds: 4 (also for
    /// 0), 8 or 12 ([`Kernel::QMatmulRows`] only; [`window_source`] writes them).
    pub weight_windows: u8,
    /// The ggml type (its id) the block-format kernels ([`Kernel::QMatmul`],
    /// [`Kernel::QMatmulRows`], [`Kernel::QMatmulTiled`], [`Kernel::QEmbed`]) are written out
    /// for: `lib/ggml_blocks.wgsl` with only that type's cases of each `switch FORMAT`, which
    /// CPU adapters compile several times faster; the `FORMAT` constant must name the same
    /// type. `None` keeps every type's cases.
    pub ggml_format: Option<u8>,
}

impl ShaderVariant {
    /// The portable-reduction variant of `kernel` in `precision`.
    pub fn new(kernel: Kernel, precision: Precision) -> Self {
        Self {
            kernel,
            precision,
            subgroups: false,
            lanes: None,
            unroll: None,
            f16_convert: false,
            pool_slots: 1,
            weight_windows: 0,
            ggml_format: None,
        }
    }

    /// The lanes attention kernel written out for `shape`.
    pub fn lanes(precision: Precision, shape: LanesShape) -> Self {
        Self {
            lanes: Some(shape),
            ..Self::new(Kernel::PagedLanes, precision)
        }
    }

    /// `kernel/precision[+subgroups]`, e.g. `paged/f16+subgroups`.
    pub fn name(&self) -> String {
        let sg = match (self.subgroups, self.f16_convert) {
            (false, false) => "",
            (true, false) => "+subgroups",
            (false, true) => "+cvt",
            (true, true) => "+subgroups+cvt",
        };
        let lanes = self
            .lanes
            .map(|l| format!("[{}]", l.name()))
            .or_else(|| self.unroll.map(|u| format!("[{}]", u.name())))
            .unwrap_or_default();
        let pools = match (self.pool_slots, self.weight_windows) {
            (_, w @ 5..) => format!("+windows{}", 4 * w.div_ceil(4)),
            (0 | 1, _) => String::new(),
            (n, _) => format!("+pools{n}"),
        };
        let format = self
            .ggml_format
            .map(|id| {
                let name = crate::ggml_source::format_name(LIB_GGML_BLOCKS, id);
                format!("+{}", name.unwrap_or_else(|| format!("ggml{id}")))
            })
            .unwrap_or_default();
        format!(
            "{}/{}{sg}{pools}{format}{lanes}",
            self.kernel.name(),
            self.precision.name()
        )
    }

    /// The composed WGSL source.
    pub fn source(&self) -> String {
        let prelude = match self.precision {
            Precision::F32 => PRELUDE_F32,
            Precision::F16 => PRELUDE_F16,
        };
        let mut src = String::from(prelude);
        for &lib in self.kernel.libs() {
            src.push('\n');
            match self.ggml_format {
                Some(id) if lib == LIB_GGML_BLOCKS => {
                    src.push_str(&crate::ggml_source::format_source(lib, id));
                }
                _ => src.push_str(lib),
            }
        }
        if self.kernel == Kernel::Paged || self.kernel.libs().contains(&LIB_GGML_BLOCKS) {
            src.push('\n');
            src.push_str(if self.f16_convert {
                LIB_HALF2_CONVERT
            } else {
                LIB_HALF2_EXACT
            });
        }
        src.push('\n');
        // The attention kernels' pool declarations: the lanes kernel's u32 and vec4 views, the
        // workgroup kernel's vec4 views.
        let (body, pools) = match self.lanes {
            Some(shape) => (shape.body(), Some((shape.pool_slots, true))),
            None => (
                self.kernel.body().to_string(),
                (self.kernel == Kernel::Paged).then_some((self.pool_slots, false)),
            ),
        };
        match pools {
            Some((slots, words)) => src.push_str(
                &body.replace(POOL_BINDINGS_MARK, &pool_bindings(u32::from(slots), words)),
            ),
            None if self.kernel == Kernel::QMatmulRows => {
                src.push_str(&window_source(&body, self.weight_windows));
            }
            None => src.push_str(&body),
        }
        if self.kernel.has_subgroup_variant() {
            // After the kernel: naga 30 mis-handles an override used in `@workgroup_size`
            // before its declaration.
            src.push('\n');
            src.push_str(if self.subgroups {
                LIB_ROWS_SUBGROUP
            } else {
                LIB_ROWS_PORTABLE
            });
        }
        match self.unroll {
            Some(shape) => size_constants(&unroll(&src, &shape.bounds()), &shape.array_sizes()),
            None => src,
        }
    }

    /// Whether the variant converts f16 with `unpack2x16float` (naga's
    /// `SHADER_FLOAT16_IN_FLOAT32`, wgpu's [`wgpu::DownlevelFlags::SHADER_F16_IN_F32`]).
    pub fn needs_f16_in_f32(&self) -> bool {
        self.kernel == Kernel::F16Check
            || self.f16_convert
            || self.lanes.is_some_and(|l| l.f16_convert)
    }

    /// The device features the variant needs.
    pub fn required_features(&self) -> wgpu::Features {
        let mut features = match self.precision {
            Precision::F32 => wgpu::Features::empty(),
            Precision::F16 => wgpu::Features::SHADER_F16,
        };
        if self.subgroups {
            features |= wgpu::Features::SUBGROUP;
        }
        features
    }
}

#[cfg(test)]
mod unroll_tests {
    use super::unroll;

    #[test]
    fn marked_loops_with_known_bounds_are_written_out() {
        let src = "fn f() {\n    for (var t = 0u; t < TILE; t++) { // @unroll\n        for (var c = 0u; c < CH; c++) { // @unroll\n            a[t * 2u + c] = 1.0;\n        }\n        b[t] = 2.0;\n    }\n    for (var i = 0u; i < N; i++) { // @unroll\n        x += 1.0;\n    }\n    for (var z = 0u; z < ZERO; z++) { // @unroll\n        y = 0.0;\n    }\n}\n";
        let out = unroll(src, &[("TILE", 2), ("CH", 3), ("ZERO", 0)]);
        // 2 x 3 inner bodies and 2 outer tails; the unknown bound N keeps its loop; ZERO none.
        assert_eq!(out.matches("a[t * 2u + c] = 1.0;").count(), 6);
        assert_eq!(out.matches("b[t] = 2.0;").count(), 2);
        assert_eq!(out.matches("const t = 1u;").count(), 1);
        assert_eq!(out.matches("const c = 2u;").count(), 2);
        assert!(out.contains("for (var i = 0u; i < N; i++) { // @unroll"));
        assert!(!out.contains("y = 0.0;"));
        assert_eq!(out.matches('{').count(), out.matches('}').count());
        // Unmarked or malformed headers stay as they are.
        let plain = "for (var t = 0u; t < TILE; t++) {\n}\n";
        assert_eq!(unroll(plain, &[("TILE", 4)]), plain);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_constants_rewrites_only_the_named_u32_constants() {
        let src = "const MAX_QREG: u32 = 32u;\nconst MAX_TILE: u32 = 16u;\n// const MAX_AREG: u32 = 32u;\nlet MAX_QREG = 1u;\n";
        let out = size_constants(src, &[("MAX_QREG", 6), ("MAX_AREG", 4)]);
        assert_eq!(
            out,
            "const MAX_QREG: u32 = 6u;\nconst MAX_TILE: u32 = 16u;\n// const MAX_AREG: u32 = 32u;\nlet MAX_QREG = 1u;\n"
        );
    }

    #[test]
    fn a_written_out_workgroup_kernel_sizes_its_arrays_for_its_shape() {
        let shape = PagedShape {
            tile: 3,
            k: (9, 2),
            rope: (1, 2),
            v: (8, 2),
        };
        let src = ShaderVariant {
            unroll: Some(shape),
            ..ShaderVariant::new(Kernel::Paged, Precision::F32)
        }
        .source();
        for line in [
            "const MAX_QREG: u32 = 60u;",
            "const MAX_AREG: u32 = 48u;",
            "const MAX_CHK: u32 = 9u;",
        ] {
            assert!(src.lines().any(|l| l == line), "missing {line}");
        }
        let wider_values = ShaderVariant {
            unroll: Some(PagedShape { k: (1, 8), ..shape }),
            ..ShaderVariant::new(Kernel::Paged, Precision::F32)
        }
        .source();
        // The value loop reads K chunks where the values are the K row: as many as either.
        for line in ["const MAX_QREG: u32 = 30u;", "const MAX_CHK: u32 = 8u;"] {
            assert!(wider_values.lines().any(|l| l == line), "missing {line}");
        }
    }

    #[test]
    fn the_row_kernel_is_written_out_for_4_8_or_12_windows() {
        let body = Kernel::QMatmulRows.body();
        let four = window_source(body, 4);
        assert!(four.contains("@binding(8) var<uniform> w3"));
        assert!(!four.contains("w4"));
        assert!(!four.contains("quad_sums(o0, chunks, t, 4u)"));
        assert_eq!(four, window_source(body, 0));
        let eight = window_source(body, 8);
        assert!(eight.contains("@binding(12) var<uniform> w7"));
        assert!(eight.contains("return w7[at / 4u][at % 4u];"));
        assert!(eight.contains("quad_sums(o0, chunks, t, 4u)"));
        assert!(!eight.contains("w8") && !eight.contains("quad_sums(o0, chunks, t, 8u)"));
        assert_eq!(eight, window_source(body, 5));
        let twelve = window_source(body, 12);
        assert!(twelve.contains("@binding(16) var<uniform> w11"));
        assert!(twelve.contains("return w11[at / 4u][at % 4u];"));
        assert!(twelve.contains("quad_sums(o0, chunks, t, 4u)"));
        assert!(twelve.contains("quad_sums(o0, chunks, t, 8u)"));
        assert!(!twelve.contains("w12"));
        for src in [&four, &eight, &twelve] {
            assert!(!src.contains(WINDOW_BINDINGS_MARK) && !src.contains(LATER_QUADS_MARK));
        }
    }

    #[test]
    fn pool_bindings_number_and_select_every_slot() {
        let one = pool_bindings(1, false);
        assert!(one.contains("const POOL_SLOTS: u32 = 1u;"));
        assert!(one.contains("@binding(2) var<storage, read> k_pool4_0"));
        assert!(one.contains("@binding(3) var<storage, read> v_pool4_0"));
        assert!(!one.contains("@binding(9)"));
        let three = pool_bindings(3, false);
        for (n, name) in [
            (2, "k_pool4_0"),
            (3, "v_pool4_0"),
            (9, "k_pool4_1"),
            (10, "v_pool4_1"),
            (11, "k_pool4_2"),
            (12, "v_pool4_2"),
        ] {
            assert!(
                three.contains(&format!("@binding({n}) var<storage, read> {name}:")),
                "binding {n} {name}"
            );
        }
        // Pools 0 to 4 by case, the last (V of slot 2) as the default.
        for which in 0..5 {
            assert!(three.contains(&format!("case {which}u:")));
        }
        assert!(three.contains("default: {\n            return v_pool4_2[i];"));
        // The lanes kernel: u32 views in those numbers, vec4 views after all of them.
        let lanes = pool_bindings(2, true);
        for (n, name) in [
            (2, "k_pool_0"),
            (10, "v_pool_1"),
            (11, "k_pool4_0"),
            (14, "v_pool4_1"),
        ] {
            assert!(
                lanes.contains(&format!("@binding({n}) var<storage, read> {name}:")),
                "lanes binding {n} {name}"
            );
        }
        assert!(lanes.contains("fn pool_word(") && lanes.contains("fn pool_vec4("));
    }
}
