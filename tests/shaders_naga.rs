//! Shader validation with no GPU: every variant the crate composes parses, validates with
//! exactly the capabilities it requests, has its overrides processed for the constants the host
//! really uses, holds no NaN or infinite constant (WebGPU refuses those), fits WebGPU's default
//! limits, and translates to SPIR-V, MSL, HLSL and GLSL.
//! The `#[repr(C)]` mirrors of WGSL structs are checked against naga's layout.

use kvattn::attention::paged::OTHER_STORAGE_BUFFERS;
use kvattn::kernels::{all_variants, param_structs, representative_constants};
use kvattn::shader::{Kernel, Precision, ShaderVariant};
use naga::valid::{Capabilities, ModuleInfo, ValidationFlags, Validator};
use naga::{AddressSpace, Module, ShaderStage, TypeInner};

fn capabilities(variant: &ShaderVariant) -> Capabilities {
    let mut caps = Capabilities::empty();
    if variant
        .required_features()
        .contains(wgpu::Features::SHADER_F16)
    {
        caps |= Capabilities::SHADER_FLOAT16;
    }
    if variant
        .required_features()
        .contains(wgpu::Features::SUBGROUP)
    {
        caps |= Capabilities::SUBGROUP;
    }
    if variant.needs_f16_in_f32() {
        caps |= Capabilities::SHADER_FLOAT16_IN_FLOAT32;
    }
    caps
}

fn parse_and_validate(
    variant: &ShaderVariant,
    caps: Capabilities,
) -> Result<(Module, ModuleInfo), String> {
    let source = variant.source();
    let module = naga::front::wgsl::parse_str(&source)
        .map_err(|e| e.emit_to_string_with_path(&source, &variant.name()))?;
    let info = Validator::new(ValidationFlags::all(), caps)
        .validate(&module)
        .map_err(|e| e.emit_to_string_with_path(&source, &variant.name()))?;
    Ok((module, info))
}

/// Bytes of workgroup memory, storage buffers bound, invocations per workgroup.
/// Workgroup bytes, storage buffers and invocations of the entry point: the globals it uses
/// (wgpu's derived layout holds those alone).
fn resources(module: &Module, info: &ModuleInfo) -> (u32, usize, u32) {
    let mut layouter = naga::proc::Layouter::default();
    layouter.update(module.to_ctx()).expect("layout");
    let used = info.get_entry_point(0);
    let mut workgroup_bytes = 0;
    let mut storage = 0;
    for (handle, var) in module.global_variables.iter() {
        if used[handle].is_empty() {
            continue;
        }
        match var.space {
            AddressSpace::WorkGroup => workgroup_bytes += layouter[var.ty].size,
            AddressSpace::Storage { .. } => storage += 1,
            _ => {}
        }
    }
    let ep = &module.entry_points[0];
    let invocations = ep.workgroup_size.iter().product();
    (workgroup_bytes, storage, invocations)
}

/// The constant expressions of `module` that are NaN or infinite: float literals (naga folds
/// most const-expressions into literals) and bit casts of integer constants to f32 (which naga
/// leaves unfolded). WGSL says a const- or override-expression that evaluates to NaN or an
/// infinity is a shader-creation (or pipeline-creation) error, and Chrome's Tint enforces it
/// where naga does not: `bitcast<f32>(0x7fc00000u)` runs on Vulkan and fails in the browser.
fn non_finite_constants(module: &Module) -> Vec<String> {
    use naga::{Expression as E, Literal as L, ScalarKind};
    // The value of an integer constant expression, through named constants.
    let int_constant = |exprs: &naga::Arena<E>, e: naga::Handle<E>| -> Option<u32> {
        let literal = |e: &E| match e {
            E::Literal(L::U32(x)) => Some(*x),
            E::Literal(L::I32(x)) => Some(*x as u32),
            E::Literal(L::AbstractInt(x)) => Some(*x as u32),
            _ => None,
        };
        match &exprs[e] {
            E::Constant(c) => literal(&module.global_expressions[module.constants[*c].init]),
            other => literal(other),
        }
    };
    let bad = |exprs: &naga::Arena<E>, e: &E| -> Option<f64> {
        let x = match e {
            E::Literal(L::F32(x)) => f64::from(*x),
            E::Literal(L::F16(x)) => f64::from(x.to_f32()),
            E::Literal(L::F64(x)) | E::Literal(L::AbstractFloat(x)) => *x,
            E::As {
                expr,
                kind: ScalarKind::Float,
                convert: None,
            } => f64::from(f32::from_bits(int_constant(exprs, *expr)?)),
            _ => return None,
        };
        (!x.is_finite()).then_some(x)
    };
    let mut found: Vec<String> = module
        .global_expressions
        .iter()
        .filter_map(|(_, e)| bad(&module.global_expressions, e).map(|x| format!("module: {x}")))
        .collect();
    let functions = module
        .functions
        .iter()
        .map(|(_, f)| f)
        .chain(module.entry_points.iter().map(|ep| &ep.function));
    for f in functions {
        let name = f.name.as_deref().unwrap_or("main");
        found.extend(
            f.expressions
                .iter()
                .filter_map(|(_, e)| bad(&f.expressions, e).map(|x| format!("fn {name}: {x}"))),
        );
    }
    found
}

fn translate(variant: &ShaderVariant, module: &Module, info: &ModuleInfo) {
    let name = variant.name();
    naga::back::spv::write_vec(module, info, &naga::back::spv::Options::default(), None)
        .unwrap_or_else(|e| panic!("{name}: SPIR-V: {e}"));
    let msl_pipeline = naga::back::msl::PipelineOptions {
        entry_point: Some((ShaderStage::Compute, "main".into())),
        ..Default::default()
    };
    let msl_options = naga::back::msl::Options {
        lang_version: (2, 1),
        ..Default::default()
    };
    naga::back::msl::write_string(module, info, &msl_options, &msl_pipeline)
        .unwrap_or_else(|e| panic!("{name}: MSL: {e}"));
    let hlsl_options = naga::back::hlsl::Options {
        shader_model: naga::back::hlsl::ShaderModel::V6_2,
        ..Default::default()
    };
    let hlsl_pipeline = naga::back::hlsl::PipelineOptions {
        entry_point: Some((ShaderStage::Compute, "main".into())),
    };
    let mut hlsl = String::new();
    naga::back::hlsl::Writer::new(&mut hlsl, &hlsl_options, &hlsl_pipeline)
        .write(module, info, None)
        .unwrap_or_else(|e| panic!("{name}: HLSL: {e}"));
    // GLSL has no f16 type and GL offers no subgroups here: those variants never run on the GL
    // backend (it lacks SHADER_F16 and SUBGROUP).
    if variant.precision == Precision::F32 && !variant.subgroups {
        let glsl_pipeline = naga::back::glsl::PipelineOptions {
            shader_stage: ShaderStage::Compute,
            entry_point: "main".into(),
            multiview: None,
        };
        let mut glsl = String::new();
        naga::back::glsl::Writer::new(
            &mut glsl,
            module,
            info,
            &naga::back::glsl::Options::default(),
            &glsl_pipeline,
            naga::proc::BoundsCheckPolicies::default(),
        )
        .and_then(|mut w| w.write())
        .unwrap_or_else(|e| panic!("{name}: GLSL: {e}"));
    }
}

#[test]
fn every_variant_validates_specializes_fits_and_translates() {
    let limits = wgpu::Limits::default();
    let variants = all_variants();
    assert!(variants.len() >= 3, "expected decode f32/f16 and dequant");
    let mut checked = 0;
    for variant in &variants {
        let (module, info) =
            parse_and_validate(variant, capabilities(variant)).unwrap_or_else(|e| panic!("{e}"));
        let non_finite = non_finite_constants(&module);
        assert!(
            non_finite.is_empty(),
            "{}: constants that are NaN or infinite (a shader-creation error in WebGPU): {non_finite:?}",
            variant.name()
        );
        let sets = representative_constants(variant);
        assert!(
            !sets.is_empty(),
            "{}: no representative constants",
            variant.name()
        );
        for constants in sets {
            let mut map = naga::back::PipelineConstants::default();
            map.extend(constants.iter().map(|&(k, v)| (k.to_string(), v)));
            let (module, info) = naga::back::pipeline_constants::process_overrides(
                &module,
                &info,
                Some((ShaderStage::Compute, "main")),
                &map,
            )
            .unwrap_or_else(|e| panic!("{} {constants:?}: overrides: {e}", variant.name()));
            let (wg_bytes, storage, invocations) = resources(&module, &info);
            let what = format!("{} {constants:?}", variant.name());
            let non_finite = non_finite_constants(&module);
            assert!(
                non_finite.is_empty(),
                "{what}: constants that are NaN or infinite after specialization: {non_finite:?}"
            );
            assert!(
                wg_bytes <= limits.max_compute_workgroup_storage_size,
                "{what}: {wg_bytes} bytes of workgroup memory"
            );
            // The attention kernels bind more than one pool buffer only where the device
            // allows them (DeviceFit::pool_slots): each slot takes K and V, and the lanes
            // kernel's wide shapes also their vec4 views. With one pool buffer (and the
            // workgroup kernel with two) they fit WebGPU's defaults.
            let (slots, views) = match (variant.kernel, variant.lanes) {
                (Kernel::Paged, _) => (usize::from(variant.pool_slots.max(1)), 1),
                (_, Some(l)) => (usize::from(l.pool_slots.max(1)), 1 + usize::from(l.wide)),
                _ => (1, 0),
            };
            if views > 0 {
                assert_eq!(
                    storage,
                    OTHER_STORAGE_BUFFERS + 2 * slots * views,
                    "{what}: storage buffers"
                );
            }
            let allowed = if slots > 1 && views > 0 {
                OTHER_STORAGE_BUFFERS + 2 * slots * views
            } else {
                limits.max_storage_buffers_per_shader_stage as usize
            };
            assert!(storage <= allowed, "{what}: {storage} storage buffers");
            assert!(
                invocations <= limits.max_compute_invocations_per_workgroup,
                "{what}: {invocations} invocations"
            );
            translate(variant, &module, &info);
            checked += 1;
        }
    }
    println!("{checked} specialized variants checked");
}

#[test]
fn f16_and_subgroup_variants_need_their_capabilities() {
    let mut checked = 0;
    for variant in all_variants() {
        let caps = capabilities(&variant);
        for needed in [Capabilities::SHADER_FLOAT16, Capabilities::SUBGROUP] {
            if caps.contains(needed) {
                assert!(
                    parse_and_validate(&variant, caps - needed).is_err(),
                    "{} validated without {needed:?}",
                    variant.name()
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 3, "f16 and subgroup variants exist");
}

#[test]
fn param_structs_match_naga_layout() {
    let mut checked = 0;
    for variant in all_variants() {
        let (module, _) = parse_and_validate(&variant, capabilities(&variant)).unwrap();
        for (name, offsets, size) in param_structs(variant.kernel) {
            let ty = module
                .types
                .iter()
                .find(|(_, t)| t.name.as_deref() == Some(name))
                .unwrap_or_else(|| panic!("{}: no WGSL struct {name}", variant.name()));
            let TypeInner::Struct { members, span } = &ty.1.inner else {
                panic!("{name} is not a struct");
            };
            let wgsl: Vec<(&str, usize)> = members
                .iter()
                .map(|m| (m.name.as_deref().unwrap_or(""), m.offset as usize))
                .collect();
            assert_eq!(
                wgsl, offsets,
                "{name}: field names/offsets differ from WGSL"
            );
            assert_eq!(*span as usize, size, "{name}: size differs from WGSL");
            checked += 1;
        }
    }
    assert!(checked >= 3);
}
