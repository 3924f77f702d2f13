//! A cache of compute pipelines keyed by (shader variant, override constants), built lazily.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::gpu::Context;
use crate::shader::ShaderVariant;
use crate::verify::clock::Stopwatch;
use crate::{Error, Result};

/// Identifies one specialized pipeline: a shader variant and its override constants.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PipelineKey {
    /// The composed shader.
    pub variant: ShaderVariant,
    /// Override constants as `(name, f64 bits)`, in the order the kernel lists them.
    constants: Vec<(&'static str, u64)>,
}

impl PipelineKey {
    /// A key for `variant` specialized with `constants`.
    pub fn new(variant: ShaderVariant, constants: &[(&'static str, f64)]) -> Self {
        Self {
            variant,
            constants: constants.iter().map(|&(n, v)| (n, v.to_bits())).collect(),
        }
    }

    /// The override constants as wgpu takes them.
    pub fn constants(&self) -> Vec<(&'static str, f64)> {
        self.constants
            .iter()
            .map(|&(n, bits)| (n, f64::from_bits(bits)))
            .collect()
    }
}

/// Shader modules per variant and pipelines per key, created on first use.
#[derive(Default)]
pub(crate) struct PipelineCache {
    modules: Mutex<HashMap<ShaderVariant, Arc<wgpu::ShaderModule>>>,
    pipelines: Mutex<HashMap<PipelineKey, Arc<wgpu::ComputePipeline>>>,
}

impl Context {
    fn shader_module(&self, variant: ShaderVariant) -> Result<Arc<wgpu::ShaderModule>> {
        let mut modules = self
            .pipelines
            .modules
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(m) = modules.get(&variant) {
            return Ok(m.clone());
        }
        let missing = variant.required_features() - self.device.features();
        if missing.contains(wgpu::Features::SHADER_F16) {
            return Err(Error::MissingFeature("shader-f16"));
        }
        if missing.contains(wgpu::Features::SUBGROUP) {
            return Err(Error::MissingFeature("subgroup"));
        }
        let module = self.compile_wgsl(&variant.name(), &variant.source())?;
        let module = Arc::new(module);
        modules.insert(variant, module.clone());
        Ok(module)
    }

    /// Compiles WGSL `source` under error scopes: invalid WGSL returns [`Error::Shader`] naming
    /// `name`, never a panic ([`Error::OutOfMemory`] and [`Error::DeviceLost`] pass through).
    pub fn compile_wgsl(&self, name: &str, source: &str) -> Result<wgpu::ShaderModule> {
        self.scoped(name, || {
            self.device
                .create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(name),
                    source: wgpu::ShaderSource::Wgsl(source.into()),
                })
        })
        .map_err(|e| match e {
            Error::Wgpu { source, .. } => Error::Shader {
                name: name.to_string(),
                source,
            },
            other => other,
        })
    }

    /// The pipeline for `key`, built (and validated) on first use. A shader or pipeline that
    /// fails validation returns [`Error::Shader`].
    pub fn pipeline(&self, key: &PipelineKey) -> Result<Arc<wgpu::ComputePipeline>> {
        if let Some(p) = self
            .pipelines
            .pipelines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(key)
        {
            return Ok(p.clone());
        }
        // Compilation time: the module (on first use of the variant) and the pipeline, counted
        // whether or not they validate.
        let clock = Stopwatch::start();
        let built = self.build_pipeline(key);
        self.counters.add_compile_nanos(clock.nanos());
        let pipeline = built?;
        self.count_pipeline();
        // Another thread may have built the same pipeline meanwhile: keep the first, so every
        // caller shares one.
        let pipeline = self
            .pipelines
            .pipelines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(key.clone())
            .or_insert_with(|| Arc::new(pipeline))
            .clone();
        Ok(pipeline)
    }

    /// Creates the shader module (if new) and the pipeline of `key`, under error scopes.
    fn build_pipeline(&self, key: &PipelineKey) -> Result<wgpu::ComputePipeline> {
        let module = self.shader_module(key.variant)?;
        let name = key.variant.name();
        let constants = key.constants();
        self.scoped(&name, || {
            self.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(&name),
                    layout: None,
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants: &constants,
                        zero_initialize_workgroup_memory: false,
                    },
                    cache: None,
                })
        })
        .map_err(|e| match e {
            Error::Wgpu { source, .. } => Error::Shader {
                name: format!("{name} {constants:?}"),
                source,
            },
            other => other,
        })
    }

    /// Binds `buffers` to bindings 0, 1, ... of group 0 (layout taken from the shader), records
    /// one dispatch of `workgroups` and submits it. A refused bind group is [`Error::Wgpu`] (or
    /// [`Error::OutOfMemory`], [`Error::DeviceLost`]) from this call; errors of the submission
    /// come back at the next sync point (see [`Context::submit`]).
    pub fn dispatch(
        &self,
        pipeline: &Arc<wgpu::ComputePipeline>,
        buffers: &[&wgpu::Buffer],
        workgroups: [u32; 3],
    ) -> Result<()> {
        let resources: Vec<wgpu::BindingResource> =
            buffers.iter().map(|b| b.as_entire_binding()).collect();
        let dispatch = self.prepare_dispatch("dispatch", pipeline, &resources, workgroups)?;
        self.run_pass("dispatch", |pass| {
            dispatch.encode(pass);
            Ok(())
        })?;
        Ok(())
    }
}
