//! `kvattn info`: which adapter kvattn picks and what it can do.

use kvattn::gpu::Context;

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
        let value = serde_json::json!({
            "adapter": a.name,
            "backend": a.backend,
            "device_type": a.device_type,
            "driver": a.driver,
            "driver_info": a.driver_info,
            "features": c.feature_names(),
            "subgroup_min_size": c.subgroup_min_size,
            "subgroup_max_size": c.subgroup_max_size,
            "max_storage_buffer_binding_size": c.max_storage_buffer_binding_size,
            "max_buffer_size": c.max_buffer_size,
            "max_storage_buffers_per_shader_stage": c.max_storage_buffers_per_shader_stage,
            "max_compute_workgroup_storage_size": c.max_compute_workgroup_storage_size,
            "max_compute_invocations_per_workgroup": c.max_compute_invocations_per_workgroup,
            "max_compute_workgroups_per_dimension": c.max_compute_workgroups_per_dimension,
        });
        println!("{value:#}");
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
