//! `kvattn info`: which adapter kvattn picks and what it can do.

use kvattn::gpu::{AdapterSummary, Capabilities, Context};
use serde_json::{Map, Value};

use crate::output;

/// Arguments of `kvattn info`.
#[derive(clap::Args)]
pub struct InfoArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Opens the context the library would use and prints its adapter, features and limits.
pub fn run(args: &InfoArgs) -> kvattn::Result<()> {
    let ctx = Context::new()?;
    let a = ctx.adapter();
    let c = ctx.caps();
    if args.json {
        print!("{}", json(a, c));
        return Ok(());
    }
    println!("adapter      {}", a.name);
    println!("backend      {}", a.backend);
    println!("device type  {}", a.device_type);
    println!("driver       {} {}", a.driver, a.driver_info);
    let features = c.feature_names();
    println!(
        "features     {}",
        if features.is_empty() {
            "none".to_string()
        } else {
            features.join(", ")
        }
    );
    if c.subgroups {
        println!(
            "subgroups    {}..{}",
            c.subgroup_min_size, c.subgroup_max_size
        );
    }
    println!(
        "f16 decode   {}",
        match (c.f16_in_f32, c.f16_unpack_exact) {
            (true, true) => "unpack2x16float (exact on all 65,536 patterns)",
            (true, false) => "integer decoder (unpack2x16float differs from the exact values)",
            (false, _) => "integer decoder (no SHADER_F16_IN_F32)",
        }
    );
    println!("limits");
    println!(
        "  max_storage_buffer_binding_size       {}",
        c.max_storage_buffer_binding_size
    );
    println!(
        "  max_buffer_size                       {}",
        c.max_buffer_size
    );
    println!(
        "  max_storage_buffers_per_shader_stage  {}",
        c.max_storage_buffers_per_shader_stage
    );
    println!(
        "  max_uniform_buffers_per_shader_stage  {}",
        c.max_uniform_buffers_per_shader_stage
    );
    println!(
        "  max_compute_workgroup_storage_size    {}",
        c.max_compute_workgroup_storage_size
    );
    println!(
        "  max_compute_invocations_per_workgroup {}",
        c.max_compute_invocations_per_workgroup
    );
    println!(
        "  max_compute_workgroups_per_dimension  {}",
        c.max_compute_workgroups_per_dimension
    );
    Ok(())
}

/// One JSON object: the adapter's fields (its name as `adapter`), its capabilities and limits
/// as the library names them, and `features`, the wgpu features kvattn uses.
fn json(a: &AdapterSummary, c: &Capabilities) -> String {
    let mut o = Map::new();
    for value in [serde_json::to_value(a), serde_json::to_value(c)] {
        if let Ok(Value::Object(fields)) = value {
            for (key, v) in fields {
                o.insert(if key == "name" { "adapter".into() } else { key }, v);
            }
        }
    }
    o.insert("features".into(), c.feature_names().into());
    output::json::pretty(&Value::Object(o))
}
