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

/// The host mirrors of `kernel`'s WGSL structs (checked against naga's layout).
pub fn param_structs(kernel: Kernel) -> Vec<StructLayout> {
    use crate::{attention, bench, cache, decoder, mla, quant, rope};
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
        Kernel::RmsNorm => vec![layout_of::<decoder::ops::rms_norm::RmsNormParams>()],
        Kernel::Swiglu => vec![layout_of::<decoder::ops::swiglu::SwigluParams>()],
        Kernel::Add => vec![layout_of::<decoder::ops::add::AddParams>()],
        Kernel::Embed => vec![layout_of::<decoder::ops::embed::EmbedParams>()],
        Kernel::Bandwidth => vec![layout_of::<bench::bandwidth::BandwidthParams>()],
        Kernel::FmaRate => vec![layout_of::<bench::fma_rate::FmaParams>()],
    }
}

/// Override-constant sets the host really uses for `kernel` in `precision`, from the smallest
/// to the largest shapes (largest workgroup memory), so validation sees the extremes. Empty for
/// [`Kernel::PagedLanes`], whose constants come with each written-out shape
/// ([`representative_constants`]).
pub fn kernel_constants(kernel: Kernel, precision: Precision) -> Vec<Constants> {
    use crate::{attention, bench, cache, decoder, mla, quant, rope};
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
        Kernel::RmsNorm => decoder::ops::rms_norm::representative_constants(),
        Kernel::Swiglu => decoder::ops::swiglu::representative_constants(),
        Kernel::Add => decoder::ops::add::representative_constants(),
        Kernel::Embed => decoder::ops::embed::representative_constants(),
        Kernel::Bandwidth => bench::bandwidth::representative_constants(),
        Kernel::FmaRate => bench::fma_rate::representative_constants(),
    }
}

/// Override-constant sets the naga tests specialize `variant` with: its kernel's
/// ([`kernel_constants`]), or for a written-out lanes kernel the one set of its shape.
pub fn representative_constants(variant: &ShaderVariant) -> Vec<Constants> {
    match variant.lanes {
        Some(shape) => crate::attention::paged::lanes_constants_for(shape, variant.precision)
            .into_iter()
            .collect(),
        None => kernel_constants(variant.kernel, variant.precision),
    }
}

/// Every shader variant the crate can compose: every kernel in each of its precisions, with
/// and without subgroups where it has a subgroup form, and the lanes kernel written out for
/// each shape its host code picks for representative problems.
pub fn all_variants() -> Vec<ShaderVariant> {
    let mut variants = Vec::new();
    for kernel in Kernel::ALL {
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
                } else {
                    variants.push(base);
                }
            }
        }
    }
    variants
}
