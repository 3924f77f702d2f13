//! Dequantize token rows on the GPU (`shaders/dequant.wgsl`): the WGSL decoders of
//! `shaders/lib/kv_load.wgsl` applied to a whole pool, written out as f32. Tests use it to check
//! the GPU decoders bit for bit against the CPU codec; `kvattn run quantize` reports it.

use super::{EncodedRows, KvDtype, ScaleMode};
use crate::gpu::Context;
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::Result;

crate::wgsl_struct! {
    /// Mirror of the WGSL `DequantParams` uniform.
    pub struct DequantParams {
        /// Rows to decode.
        pub num_rows: u32,
        /// Invocations along x of the dispatch grid.
        pub stride_x: u32,
        /// Padding to 16 bytes.
        pub _pad0: u32,
        /// Padding to 16 bytes.
        pub _pad1: u32,
    }
}

const WG: u32 = 64;

fn constants(dtype: KvDtype, head_dim: usize, mode: ScaleMode) -> Vec<(&'static str, f64)> {
    vec![
        ("K_DTYPE", f64::from(dtype.code())),
        ("K_DIM", head_dim as f64),
        (
            "K_SCALE_PER_TENSOR",
            f64::from(u8::from(matches!(mode, ScaleMode::PerTensor(_)))),
        ),
    ]
}

/// Override constants for the naga tests: every format, the smallest and largest head dims.
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    KvDtype::ALL
        .iter()
        .flat_map(|&dtype| {
            let mode = if dtype.fp8_format().is_some() {
                ScaleMode::PerTensor(1.0)
            } else {
                ScaleMode::PerRow
            };
            [32, 1024].map(move |d| constants(dtype, d, mode))
        })
        .collect()
}

/// Decodes every row of `rows` on the GPU and reads the f32 values back (`[rows, head_dim]`).
pub fn dequantize(ctx: &Context, rows: &EncodedRows) -> Result<Vec<f32>> {
    rows.validate()?;
    let n = rows.num_rows();
    let len = n * rows.head_dim;
    let vec4s = (len / 4) as u32;
    let groups = vec4s.div_ceil(WG).max(1);
    let max = ctx.caps().max_compute_workgroups_per_dimension;
    let (gx, gy) = if groups <= max {
        (groups, 1)
    } else {
        (max, groups.div_ceil(max))
    };
    let params = DequantParams {
        num_rows: n as u32,
        stride_x: gx * WG,
        ..Default::default()
    };
    let key = PipelineKey::new(
        ShaderVariant::new(Kernel::Dequant, Precision::F32),
        &constants(rows.dtype, rows.head_dim, rows.scale_mode),
    );
    let pipeline = ctx.pipeline(&key)?;
    let uniform = ctx.uniform("dequant params", &params);
    let pool = ctx.upload("dequant pool", &rows.interleaved_words())?;
    let scales = ctx.upload("dequant scales", &rows.scale_pool_words())?;
    let out = ctx.filled("dequant out", len, f32::NAN)?;
    ctx.dispatch(&pipeline, &[&uniform, &pool, &scales, &out], [gx, gy, 1])?;
    ctx.read_back(&out, len)
}
