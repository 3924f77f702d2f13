//! The registry of every kernel the crate builds, assembled above the kernel modules: each
//! kernel module declares its own parameter structs (host mirrors of its WGSL uniforms) and the
//! override constants its host code really uses; this module lists them for the naga tests
//! (`tests/shaders_naga.rs`) without [`shader`](crate::shader) having to know any kernel.
//!
//! The dependency runs one way: kernel modules use [`shader`](crate::shader) to compose their
//! source, and this module uses the kernel modules.

use crate::gpu::WgslStruct;
use crate::shader::{Kernel, Precision, ShaderVariant};

/// A host struct's layout as the layout test sees it: WGSL name, field offsets, size.
pub type StructLayout = (&'static str, Vec<(&'static str, usize)>, usize);

/// One set of override constants: `(name, value)` pairs.
pub type Constants = Vec<(&'static str, f64)>;

/// The layout of the host mirror `T`.
pub fn layout_of<T: WgslStruct>() -> StructLayout {
    (T::WGSL_NAME, T::field_offsets(), std::mem::size_of::<T>())
}

/// Whether the enabled features build `kernel`: the decoder's kernels ([`Kernel::RmsNorm`],
/// [`Kernel::Swiglu`], [`Kernel::Add`], [`Kernel::Embed`], [`Kernel::QMatmul`],
/// [`Kernel::QEmbed`]) need the `decoder` feature, the ceilings' kernels ([`Kernel::Bandwidth`],
/// [`Kernel::FmaRate`]) the `bench` feature.
pub fn is_built(kernel: Kernel) -> bool {
    let decoder = matches!(
        kernel,
        Kernel::RmsNorm
            | Kernel::Swiglu
            | Kernel::Add
            | Kernel::Embed
            | Kernel::QMatmul
            | Kernel::QMatmulRows
            | Kernel::QMatmulTiled
            | Kernel::QEmbed
    );
    let bench = matches!(kernel, Kernel::Bandwidth | Kernel::FmaRate);
    (!decoder || cfg!(feature = "decoder")) && (!bench || cfg!(feature = "bench"))
}

/// The host mirrors of `kernel`'s WGSL structs (checked against naga's layout); empty for a
/// kernel the enabled features do not build ([`is_built`]).
pub fn param_structs(kernel: Kernel) -> Vec<StructLayout> {
    #[cfg(feature = "bench")]
    use crate::bench;
    #[cfg(feature = "decoder")]
    use crate::decoder;
    use crate::{attention, cache, mla, quant, rope};
    match kernel {
        Kernel::Paged | Kernel::PagedLanes => vec![
            layout_of::<attention::paged::PagedParams>(),
            layout_of::<cache::pool::TensorScale>(),
        ],
        Kernel::Merge => vec![layout_of::<attention::merge::MergeParams>()],
        Kernel::MergeStates => vec![layout_of::<attention::merge_states::MergeStatesParams>()],
        Kernel::Dequant => vec![layout_of::<quant::dequant::DequantParams>()],
        Kernel::AppendKv => vec![
            layout_of::<cache::append_kv::AppendParams>(),
            layout_of::<cache::pool::TensorScale>(),
        ],
        Kernel::CopyBlocks => vec![layout_of::<cache::copy_blocks::CopyParams>()],
        Kernel::Rope => vec![layout_of::<rope::RopeParams>()],
        Kernel::HeadMatmul => mla::head_matmul::param_structs(),
        Kernel::StridedCopy => mla::strided_copy::param_structs(),
        #[cfg(feature = "decoder")]
        Kernel::RmsNorm => vec![layout_of::<decoder::ops::rms_norm::RmsNormParams>()],
        #[cfg(feature = "decoder")]
        Kernel::Swiglu => vec![layout_of::<decoder::ops::swiglu::SwigluParams>()],
        #[cfg(feature = "decoder")]
        Kernel::Add => vec![layout_of::<decoder::ops::add::AddParams>()],
        #[cfg(feature = "decoder")]
        Kernel::Embed => vec![layout_of::<decoder::ops::embed::EmbedParams>()],
        #[cfg(feature = "decoder")]
        Kernel::QMatmul | Kernel::QMatmulRows | Kernel::QMatmulTiled => {
            vec![layout_of::<decoder::ops::qmatmul::QMatmulParams>()]
        }
        #[cfg(feature = "decoder")]
        Kernel::QEmbed => vec![layout_of::<decoder::ops::qembed::QEmbedParams>()],
        #[cfg(not(feature = "decoder"))]
        Kernel::RmsNorm
        | Kernel::Swiglu
        | Kernel::Add
        | Kernel::Embed
        | Kernel::QMatmul
        | Kernel::QMatmulRows
        | Kernel::QMatmulTiled
        | Kernel::QEmbed => Vec::new(),
        #[cfg(feature = "bench")]
        Kernel::Bandwidth => vec![layout_of::<bench::bandwidth::BandwidthParams>()],
        #[cfg(feature = "bench")]
        Kernel::FmaRate => vec![layout_of::<bench::fma_rate::FmaParams>()],
        #[cfg(not(feature = "bench"))]
        Kernel::Bandwidth | Kernel::FmaRate => Vec::new(),
        Kernel::F16Check => Vec::new(),
    }
}

/// Override-constant sets the host really uses for `kernel` in `precision`, from the smallest
/// to the largest shapes (largest workgroup memory), so validation sees the extremes. Empty for
/// [`Kernel::PagedLanes`], whose constants come with each written-out shape
/// ([`representative_constants`]), and for a kernel the enabled features do not build
/// ([`is_built`]).
pub fn kernel_constants(kernel: Kernel, precision: Precision) -> Vec<Constants> {
    #[cfg(feature = "bench")]
    use crate::bench;
    #[cfg(feature = "decoder")]
    use crate::decoder;
    use crate::{attention, cache, mla, quant, rope};
    match kernel {
        Kernel::Paged => attention::paged::representative_constants(precision),
        Kernel::PagedLanes => Vec::new(),
        Kernel::Merge => attention::merge::representative_constants(),
        Kernel::MergeStates => attention::merge_states::representative_constants(),
        Kernel::Dequant => quant::dequant::representative_constants(),
        Kernel::AppendKv => cache::append_kv::representative_constants(),
        Kernel::CopyBlocks => cache::copy_blocks::representative_constants(),
        Kernel::Rope => rope::representative_constants(),
        Kernel::HeadMatmul => mla::head_matmul::representative_constants(),
        Kernel::StridedCopy => mla::strided_copy::representative_constants(),
        #[cfg(feature = "decoder")]
        Kernel::RmsNorm => decoder::ops::rms_norm::representative_constants(),
        #[cfg(feature = "decoder")]
        Kernel::Swiglu => decoder::ops::swiglu::representative_constants(),
        #[cfg(feature = "decoder")]
        Kernel::Add => decoder::ops::add::representative_constants(),
        #[cfg(feature = "decoder")]
        Kernel::Embed => decoder::ops::embed::representative_constants(),
        #[cfg(feature = "decoder")]
        Kernel::QMatmul => decoder::ops::qmatmul::representative_constants(),
        #[cfg(feature = "decoder")]
        Kernel::QMatmulRows => decoder::ops::qmatmul::row_representative_constants(),
        #[cfg(feature = "decoder")]
        Kernel::QMatmulTiled => decoder::ops::qmatmul::format_representative_constants(),
        #[cfg(feature = "decoder")]
        Kernel::QEmbed => decoder::ops::qembed::representative_constants(),
        #[cfg(not(feature = "decoder"))]
        Kernel::RmsNorm
        | Kernel::Swiglu
        | Kernel::Add
        | Kernel::Embed
        | Kernel::QMatmul
        | Kernel::QMatmulRows
        | Kernel::QMatmulTiled
        | Kernel::QEmbed => Vec::new(),
        #[cfg(feature = "bench")]
        Kernel::Bandwidth => bench::bandwidth::representative_constants(),
        #[cfg(feature = "bench")]
        Kernel::FmaRate => bench::fma_rate::representative_constants(),
        #[cfg(not(feature = "bench"))]
        Kernel::Bandwidth | Kernel::FmaRate => Vec::new(),
        Kernel::F16Check => vec![Vec::new()],
    }
}

/// Override-constant sets the naga tests specialize `variant` with: its kernel's
/// ([`kernel_constants`]), or for a written-out lanes kernel the one set of its shape.
pub fn representative_constants(variant: &ShaderVariant) -> Vec<Constants> {
    let constant = |set: &Constants, name: &str| set.iter().find(|(n, _)| *n == name).map(|c| c.1);
    let sets = match (variant.lanes, variant.unroll) {
        (Some(shape), _) => crate::attention::paged::lanes_constants_for(shape, variant.precision)
            .into_iter()
            .collect(),
        // A written-out workgroup kernel takes only the sets of its own shape.
        (None, Some(shape)) => kernel_constants(variant.kernel, variant.precision)
            .into_iter()
            .filter(|set| crate::attention::paged::shape_of_constants(set) == shape)
            .collect(),
        // The row kernel's variants take the window counts they serve (those their whole
        // quads of 4 hold: 1 to 4, 5 to 8, 9 to 12).
        (None, None) if variant.kernel == Kernel::QMatmulRows => {
            kernel_constants(variant.kernel, variant.precision)
                .into_iter()
                .filter(|set| {
                    let windows = constant(set, "WINDOWS").unwrap_or(1.0) as u8;
                    windows.max(1).div_ceil(4) == variant.weight_windows.max(1).div_ceil(4)
                })
                .collect()
        }
        (None, None) => kernel_constants(variant.kernel, variant.precision),
    };
    // A block-format kernel written out for one type takes that type's sets.
    match variant.ggml_format {
        Some(id) => sets
            .into_iter()
            .filter(|set| constant(set, "FORMAT") == Some(f64::from(id)))
            .collect(),
        None => sets,
    }
}

/// Every shader variant the crate can compose with the enabled features: every kernel it builds
/// ([`is_built`]) in each of its precisions, with and without subgroups where it has a subgroup
/// form, and the lanes kernel written out for each shape its host code picks for representative
/// problems.
pub fn all_variants() -> Vec<ShaderVariant> {
    let mut variants = Vec::new();
    for kernel in Kernel::ALL.into_iter().filter(|&k| is_built(k)) {
        for &precision in kernel.precisions() {
            let subgroups: &[bool] = if kernel.has_subgroup_variant() {
                &[false, true]
            } else {
                &[false]
            };
            for &sg in subgroups {
                let base = ShaderVariant {
                    subgroups: sg,
                    ..ShaderVariant::new(kernel, precision)
                };
                if kernel == Kernel::PagedLanes {
                    variants.extend(
                        crate::attention::paged::lanes_representative_shapes(precision)
                            .into_iter()
                            .map(|shape| ShaderVariant {
                                lanes: Some(shape),
                                ..base
                            }),
                    );
                } else if kernel == Kernel::Paged {
                    // With its loops and written out for each representative shape (the form
                    // plans run), with the exact integer f16 decoder and, alternately, with
                    // unpack2x16float.
                    variants.push(base);
                    variants.push(ShaderVariant {
                        f16_convert: true,
                        ..base
                    });
                    let mut shapes: Vec<_> = kernel_constants(kernel, precision)
                        .iter()
                        .map(|set| crate::attention::paged::shape_of_constants(set))
                        .collect();
                    shapes.sort();
                    shapes.dedup();
                    for (i, shape) in shapes.into_iter().enumerate() {
                        variants.push(ShaderVariant {
                            unroll: Some(shape),
                            f16_convert: i % 2 == 1,
                            // Pools bound whole over 2 buffers (WebGPU's default limits) and
                            // over the most slots, alternately with one.
                            pool_slots: [1, 2, crate::attention::paged::MAX_POOL_SLOTS as u8]
                                [i % 3],
                            ..base
                        });
                    }
                } else if matches!(
                    kernel,
                    Kernel::QMatmul | Kernel::QMatmulRows | Kernel::QMatmulTiled | Kernel::QEmbed
                ) {
                    // Written out for each weight type (ShaderVariant::ggml_format).
                    #[cfg(feature = "decoder")]
                    variants.extend(crate::decoder::ops::qmatmul::format_variants(kernel));
                } else {
                    variants.push(base);
                }
            }
        }
    }
    variants
}
