//! The context: adapter choice, features, limits, typed errors instead of panics, the
//! pipeline cache, buffers.

use std::sync::Arc;

use kvattn::cache::pool::{BlockPool, PoolLayout};
use kvattn::gpu::{Context, ContextOptions};
use kvattn::pipeline::PipelineKey;
use kvattn::quant::KvDtype;
use kvattn::shader::{Kernel, Precision, ShaderVariant};
use kvattn::Error;

use crate::common::gpu;

#[test]
fn capabilities_reflect_the_device() {
    let ctx = gpu();
    let caps = ctx.caps();
    let features = ctx.device.features();
    assert_eq!(
        caps.shader_f16,
        features.contains(wgpu::Features::SHADER_F16)
    );
    assert_eq!(caps.subgroups, features.contains(wgpu::Features::SUBGROUP));
    assert_eq!(
        caps.timestamps,
        features.contains(wgpu::Features::TIMESTAMP_QUERY)
    );
    let limits = ctx.device.limits();
    assert_eq!(
        caps.max_storage_buffer_binding_size,
        limits.max_storage_buffer_binding_size
    );
    assert!(caps.max_storage_buffer_binding_size >= 128 << 20);
    if caps.subgroups {
        assert!(caps.subgroup_min_size >= 1 && caps.subgroup_min_size <= caps.subgroup_max_size);
    }
    assert!(!ctx.adapter().name.is_empty());
}

#[test]
fn unknown_adapter_name_is_a_typed_error_with_a_hint() {
    let opts = ContextOptions {
        adapter_name: Some("no adapter is called this".into()),
        ..Default::default()
    };
    let err = Context::with_options(&opts).unwrap_err();
    assert!(matches!(err, Error::NoAdapter { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("mesa-vulkan-drivers") && text.contains("WGPU_BACKEND=gl"),
        "{text}"
    );
}

#[test]
fn disabled_features_are_not_requested() {
    let opts = ContextOptions {
        disable_f16: true,
        disable_subgroups: true,
        ..Default::default()
    };
    let ctx = Context::with_options(&opts).unwrap();
    assert!(!ctx.caps().shader_f16 && !ctx.caps().subgroups);
    assert!(!ctx.device.features().contains(wgpu::Features::SHADER_F16));
    let key = PipelineKey::new(ShaderVariant::new(Kernel::Paged, Precision::F16), &[]);
    assert!(matches!(
        ctx.pipeline(&key),
        Err(Error::MissingFeature("shader-f16"))
    ));
}

#[test]
fn invalid_wgsl_is_a_shader_error_not_a_panic() {
    let ctx = gpu();
    let err = ctx
        .compile_wgsl(
            "broken",
            "@compute @workgroup_size(1) fn main() { let x: u32 = 1.5; }",
        )
        .unwrap_err();
    match err {
        Error::Shader { name, source } => {
            assert_eq!(name, "broken");
            assert!(matches!(source, wgpu::Error::Validation { .. }), "{source}");
            assert!(!source.to_string().is_empty());
        }
        other => panic!("expected Error::Shader, got {other}"),
    }
    // An override the shader does not declare fails pipeline creation with a typed error too.
    let key = PipelineKey::new(
        ShaderVariant::new(Kernel::Dequant, Precision::F32),
        &[("NO_SUCH_OVERRIDE", 1.0)],
    );
    assert!(matches!(ctx.pipeline(&key), Err(Error::Shader { .. })));
}

#[test]
fn pipelines_are_cached_by_variant_and_constants() {
    let ctx = gpu();
    let variant = ShaderVariant::new(Kernel::Dequant, Precision::F32);
    let a = ctx
        .pipeline(&PipelineKey::new(variant, &[("K_DIM", 64.0)]))
        .unwrap();
    let b = ctx
        .pipeline(&PipelineKey::new(variant, &[("K_DIM", 64.0)]))
        .unwrap();
    let c = ctx
        .pipeline(&PipelineKey::new(variant, &[("K_DIM", 128.0)]))
        .unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    assert!(!Arc::ptr_eq(&a, &c));
}

#[test]
fn buffers_round_trip_and_respect_the_binding_cap() {
    let ctx = gpu();
    let data: Vec<u32> = (0..1001).map(|i| i * 7 + 3).collect();
    let buf = ctx.upload("data", &data).unwrap();
    assert_eq!(ctx.read_back::<u32>(&buf, data.len()).unwrap(), data);
    // Tiny uploads are padded to a bindable size but read back exactly.
    let one = ctx.upload("one", &[42u32]).unwrap();
    assert_eq!(ctx.read_back::<u32>(&one, 1).unwrap(), vec![42]);
    assert!(matches!(
        ctx.read_back::<u32>(&one, 100),
        Err(Error::InvalidArgument(_))
    ));
    let nan = ctx.filled("nan", 10, f32::NAN).unwrap();
    assert!(ctx
        .read_back::<f32>(&nan, 10)
        .unwrap()
        .iter()
        .all(|x| x.is_nan()));

    let capped = Context::with_options(&ContextOptions {
        max_storage_binding_cap: Some(1024),
        ..Default::default()
    })
    .unwrap();
    // The cap shapes KV pools, not other buffers (those meet the device's own limit).
    assert_eq!(capped.caps().max_storage_buffer_binding_size, 1024);
    assert!(capped.upload("bigger than the cap", &[0u32; 1000]).is_ok());
    let layout = PoolLayout {
        num_kv_heads: 1,
        head_dim: 64,
        dtype: KvDtype::F32,
        block_size: 1,

        scale: kvattn::quant::ScaleMode::PerRow,
    };
    let pool = BlockPool::new(&capped, layout, 10, "capped").unwrap();
    assert_eq!(pool.blocks_per_buffer(), 4);
    assert_eq!(pool.buffers().len(), 3);
    // A block larger than the cap cannot be placed.
    let huge = PoolLayout {
        head_dim: 512,
        ..layout
    };
    assert!(matches!(
        BlockPool::new(&capped, huge, 1, "huge"),
        Err(Error::TooLarge {
            bytes: 2048,
            limit: 1024,
            ..
        })
    ));
}

#[test]
fn the_f16_check_decides_the_f16_conversion() {
    // Kernels convert f16 with unpack2x16float only where the context found it exact for all
    // 65,536 patterns; the check run again here must agree with that decision.
    let ctx = gpu();
    if !ctx.caps().f16_in_f32 {
        assert!(!ctx.caps().f16_unpack_exact);
        assert!(matches!(
            kvattn::gpu::f16_check::unpack_mismatches(ctx),
            Err(Error::MissingFeature(_))
        ));
        return;
    }
    let mismatches = kvattn::gpu::f16_check::unpack_mismatches(ctx).unwrap();
    assert_eq!(
        ctx.caps().f16_unpack_exact,
        mismatches.is_empty(),
        "{} patterns differ, the first {:x?}",
        mismatches.len(),
        &mismatches[..mismatches.len().min(8)]
    );
}
