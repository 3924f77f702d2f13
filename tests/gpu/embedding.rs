//! kvattn inside an application that owns the device: `Context::from_wgpu` on a device made
//! with plain wgpu, capabilities from what that device was created with, no handlers taken
//! from the application, errors of submissions at the next sync point, readbacks that wait for
//! their own submission.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvattn::attention::paged::{paged_attention_host, PagedAttentionArgs, PagedQuery};
use kvattn::attention::{AttentionOptions, AttentionShape};
use kvattn::cache::paged::{PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::gpu::{Context, ContextOptions, Readback};
use kvattn::quant::KvDtype;
use kvattn::shader::Precision;
use kvattn::Error;

use crate::common::{gpu, own_context, test_context_options, Rng};

/// The adapter `Context::new` would pick (same environment variables), opened with plain wgpu.
fn app_adapter() -> wgpu::Adapter {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle().with_env();
    desc.backends = desc_backends();
    let instance = wgpu::Instance::new(desc);
    let name = gpu().adapter().name.clone();
    let adapters = pollster::block_on(instance.enumerate_adapters(desc_backends()));
    adapters
        .into_iter()
        .find(|a| {
            a.get_info().name == name && a.get_info().backend.to_str() == gpu().adapter().backend
        })
        .expect("the test adapter is visible to plain wgpu")
}

fn desc_backends() -> wgpu::Backends {
    wgpu::Backends::from_env().unwrap_or(wgpu::Backends::PRIMARY | wgpu::Backends::GL)
}

/// A device as an application would make it: `features` and `limits` of its choosing.
fn app_device(
    adapter: &wgpu::Adapter,
    features: wgpu::Features,
    limits: wgpu::Limits,
) -> (wgpu::Device, wgpu::Queue) {
    pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("application device"),
        required_features: features,
        required_limits: limits,
        experimental_features: wgpu::ExperimentalFeatures::disabled(),
        memory_hints: wgpu::MemoryHints::Performance,
        trace: wgpu::Trace::Off,
    }))
    .expect("the application's device")
}

fn embedded(features: wgpu::Features, limits: Option<wgpu::Limits>) -> (Context, wgpu::Adapter) {
    let adapter = app_adapter();
    let limits = limits.unwrap_or_else(|| adapter.limits());
    let (device, queue) = app_device(&adapter, features, limits);
    // The shared context's options, so that their bits may be compared.
    let ctx = Context::from_wgpu(device, queue, &adapter, &test_context_options()).unwrap();
    (ctx, adapter)
}

#[test]
fn capabilities_come_from_the_device_not_the_adapter() {
    let adapter = app_adapter();
    let mut limits = adapter.limits();
    limits.max_storage_buffer_binding_size = 1 << 20;
    let (ctx, adapter) = embedded(wgpu::Features::empty(), Some(limits));
    assert!(!ctx.owns_device());
    let caps = ctx.caps();
    // Whatever the adapter offers, a device created without the features has none of them.
    assert!(
        !caps.shader_f16 && !caps.subgroups && !caps.timestamps,
        "{caps:?}"
    );
    assert_eq!(caps.max_storage_buffer_binding_size, 1 << 20);
    assert_eq!(ctx.adapter().name, adapter.get_info().name);

    // With the features the adapter has, the device (and so kvattn) has them too.
    let wanted =
        wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP | wgpu::Features::TIMESTAMP_QUERY;
    let have = adapter.features() & wanted;
    let (full, _) = embedded(have, None);
    assert_eq!(
        full.caps().shader_f16,
        have.contains(wgpu::Features::SHADER_F16)
    );
    assert_eq!(
        full.caps().subgroups,
        have.contains(wgpu::Features::SUBGROUP)
    );
    assert_eq!(
        full.caps().timestamps,
        have.contains(wgpu::Features::TIMESTAMP_QUERY)
    );
}

fn attention_case(ctx: &Context) -> Vec<u32> {
    let shape = AttentionShape {
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim_qk: 32,
        head_dim_v: 32,
    };
    let mut cache = PagedKvCache::new(
        ctx,
        PagedKvConfig::new(1, 2, 32, KvDtype::F16),
        PoolSize::Blocks(8),
    )
    .unwrap();
    let mut rng = Rng::new(16);
    let len = 37;
    cache.add_sequence(0, &[]).unwrap();
    let k = rng.normals(len * 64, 1.0);
    let v = rng.normals(len * 64, 1.0);
    let tokens: Vec<u32> = (0..len as u32).collect();
    cache.append_host(ctx, 0, &tokens, &[k], &[v]).unwrap();
    let q = rng.normals(4 * 32, 1.0);
    let out = paged_attention_host(
        ctx,
        &cache,
        &PagedAttentionArgs {
            layer: 0,
            batch: &[PagedQuery { seq: 0, len_q: 1 }],
            shape,
            options: &AttentionOptions::default(),
            precision: Precision::F32,
        },
        &q,
    )
    .unwrap();
    out.out
        .iter()
        .chain(&out.lse)
        .map(|x| x.to_bits())
        .collect()
}

#[test]
fn attention_on_an_application_device_matches_kvattns_own_device() {
    // The same features as kvattn's own device (the f16 and subgroup variants differ in the
    // last bits from the portable ones, legitimately).
    let wanted =
        wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP | wgpu::Features::TIMESTAMP_QUERY;
    let (ctx, _) = embedded(app_adapter().features() & wanted, None);
    assert_eq!(ctx.caps().shader_f16, gpu().caps().shader_f16);
    assert_eq!(attention_case(&ctx), attention_case(gpu()));
}

#[test]
fn kvattn_leaves_the_applications_error_handler_alone() {
    let adapter = app_adapter();
    let (device, queue) = app_device(&adapter, wgpu::Features::empty(), adapter.limits());
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&seen);
    device.on_uncaptured_error(Arc::new(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    let ctx = Context::from_wgpu(device, queue, &adapter, &ContextOptions::default()).unwrap();
    // The application's own mistake, outside any scope, reaches the application's handler.
    let _bad = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("invalid usage"),
        size: 16,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    // kvattn's own work keeps working and its sync points do not report the application's error.
    let data: Vec<u32> = (0..64).collect();
    let buf = ctx.upload("data", &data).unwrap();
    assert_eq!(ctx.read_back::<u32>(&buf, 64).unwrap(), data);
    ctx.check_errors().unwrap();
    // A bad submission made through kvattn comes back from kvattn, not through the handler.
    let src = ctx.upload("src", &data).unwrap();
    let mut encoder = ctx.encoder("bad copy");
    encoder.copy_buffer_to_buffer(&src, 0, &buf, 4, 1024);
    ctx.submit("bad copy", encoder).unwrap();
    assert!(matches!(ctx.check_errors(), Err(Error::Wgpu { .. })));
    assert_eq!(
        seen.load(Ordering::SeqCst),
        1,
        "the handler saw only the application's error"
    );
}

#[test]
fn submission_errors_come_back_once_at_the_next_sync_point() {
    let ctx = Context::with_options(&ContextOptions::default()).unwrap();
    let data: Vec<u32> = (0..64).collect();
    let a = ctx.upload("a", &data).unwrap();
    let b = ctx.upload("b", &data).unwrap();
    let mut encoder = ctx.encoder("copy past the end");
    encoder.copy_buffer_to_buffer(&a, 0, &b, 8, 256);
    // Submitting does not wait for the verdict...
    ctx.submit("copy past the end", encoder).unwrap();
    // ...the next readback reports it, typed, naming the submission.
    match ctx.read_back::<u32>(&b, 64) {
        Err(e @ Error::Wgpu { .. }) => assert!(e.to_string().contains("copy past the end"), "{e}"),
        other => panic!("expected the submission's error, got {other:?}"),
    }
    // Reported once: the context is usable again.
    assert_eq!(ctx.read_back::<u32>(&b, 64).unwrap(), data);
    ctx.check_errors().unwrap();
}

#[test]
fn readbacks_wait_for_their_own_submission_and_reuse_their_staging() {
    // A context of its own: the counters below must not see other tests' submissions (they
    // did, with 8 test threads on a fast GPU).
    let ctx = &own_context(None);
    let data: Vec<f32> = (0..300).map(|i| i as f32 * 0.5).collect();
    let buf = ctx.upload("data", &data).unwrap();
    assert_eq!(
        pollster::block_on(ctx.read_back_async::<f32>(&buf, 300)).unwrap(),
        data
    );
    let readback = Readback::new(ctx, "reused staging", 300 * 4).unwrap();
    let before = ctx.counters();
    for round in 0..3u32 {
        let words: Vec<u32> = (0..300).map(|i| i * 7 + round).collect();
        ctx.write_buffer(&buf, 0, bytemuck::cast_slice(&words))
            .unwrap();
        let mut encoder = ctx.encoder("copy out");
        readback
            .encode_copy(&mut encoder, &buf, 0, 300 * 4)
            .unwrap();
        let index = ctx.submit("copy out", encoder).unwrap();
        assert_eq!(readback.read::<u32>(ctx, index, 300).unwrap(), words);
    }
    let used = ctx.counters().since(&before);
    assert_eq!(used.submissions, 3);
    assert_eq!(used.buffers_created, 0, "{used:?}");
    assert_eq!(used.bytes_uploaded, 3 * 300 * 4);
    // Past the staging buffer, or unaligned: refused before recording.
    let mut encoder = ctx.encoder("too much");
    assert!(matches!(
        readback.encode_copy(&mut encoder, &buf, 0, 301 * 4),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        readback.encode_copy(&mut encoder, &buf, 2, 16),
        Err(Error::InvalidArgument(_))
    ));
}

#[cfg(feature = "decoder")]
#[test]
fn a_buffer_of_another_device_is_refused_before_anything_is_recorded() {
    // Two devices of one application (one instance): kvattn runs on the first.
    let adapter = app_adapter();
    let (device, queue) = app_device(&adapter, wgpu::Features::empty(), adapter.limits());
    let (other, _other_queue) = app_device(&adapter, wgpu::Features::empty(), adapter.limits());
    let ctx = Context::from_wgpu(device, queue, &adapter, &ContextOptions::default()).unwrap();
    let foreign = other.create_buffer(&wgpu::BufferDescriptor {
        label: Some("foreign"),
        size: 256,
        usage: kvattn::gpu::STORAGE,
        mapped_at_creation: false,
    });
    let own = ctx.upload("own", &[1.0f32; 64]).unwrap();
    let before = ctx.counters();
    // The residual add binds (uniform, x, y): y from the other device.
    let result = kvattn::decoder::ops::add::add_in_place(&ctx, 64, &own, &foreign);
    assert!(matches!(result, Err(Error::Wgpu { .. })), "{result:?}");
    assert_eq!(
        ctx.counters().submissions,
        before.submissions,
        "nothing submitted"
    );
    ctx.check_errors().unwrap();
}

#[test]
fn write_buffer_checks_usage_alignment_and_bounds() {
    let ctx = gpu();
    let buf = ctx.upload("target", &[0u32; 16]).unwrap();
    assert!(matches!(
        ctx.write_buffer(&buf, 2, &[0; 4]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ctx.write_buffer(&buf, 0, &[0; 6]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ctx.write_buffer(&buf, 60, &[0; 8]),
        Err(Error::InvalidArgument(_))
    ));
    let uniform_only = ctx
        .create_buffer(&wgpu::BufferDescriptor {
            label: Some("no copy dst"),
            size: 16,
            usage: wgpu::BufferUsages::UNIFORM,
            mapped_at_creation: false,
        })
        .unwrap();
    assert!(matches!(
        ctx.write_buffer(&uniform_only, 0, &[0; 4]),
        Err(Error::InvalidArgument(_))
    ));
    ctx.write_buffer(&buf, 60, &[1, 0, 0, 0]).unwrap();
    assert_eq!(ctx.read_back::<u32>(&buf, 16).unwrap()[15], 1);
}

#[test]
fn errors_of_many_unsynced_submissions_are_all_counted() {
    // More submissions than the context keeps unsettled: every error still reaches the next
    // sync point, the first by name and the rest counted.
    let ctx = crate::common::own_context(None);
    let data: Vec<u32> = (0..64).collect();
    let a = ctx.upload("a", &data).unwrap();
    let b = ctx.upload("b", &data).unwrap();
    for i in 0..40 {
        let mut encoder = ctx.encoder("copy past the end");
        encoder.copy_buffer_to_buffer(&a, 0, &b, 8, 256);
        ctx.submit(&format!("bad copy {i}"), encoder).unwrap();
    }
    match ctx.check_errors() {
        Err(e @ Error::Wgpu { more: 39, .. }) => {
            let m = e.to_string();
            assert!(m.contains("bad copy 0"), "{m}");
            assert!(m.contains("(and 39 more)"), "{m}");
        }
        other => panic!("expected the submissions' errors, got {other:?}"),
    }
    ctx.check_errors().unwrap();
}
