//! wgpu errors as typed errors, never panics: refused copies, buffers past the device's limits,
//! errors raised outside any error scope, and device loss; wgpu's (and safetensors') own error
//! kept as the `source()`. Each test opens its own context, so an error it provokes (or a
//! destroyed device) cannot reach another test.

use kvattn::attention::paged::{paged_attention_host, PagedAttentionArgs, PagedQuery};
use kvattn::attention::{AttentionOptions, AttentionShape};
use kvattn::cache::paged::{PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::gpu::Context;
use kvattn::quant::KvDtype;
use kvattn::shader::Precision;
use kvattn::Error;

use crate::common::{own_context, Rng};

/// A raw buffer made on the device directly, outside kvattn.
fn raw_buffer(ctx: &Context, size: u64, usage: wgpu::BufferUsages) -> wgpu::Buffer {
    ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("raw"),
        size,
        usage,
        mapped_at_creation: false,
    })
}

/// The context still works: a round trip through upload and readback.
fn assert_usable(ctx: &Context) {
    let data: Vec<u32> = (0..300).map(|i| i * 3 + 1).collect();
    let buf = ctx.upload("after", &data).unwrap();
    assert_eq!(ctx.read_back::<u32>(&buf, data.len()).unwrap(), data);
    ctx.wait().unwrap();
}

#[test]
fn readback_of_a_buffer_without_copy_src_is_refused_before_recording() {
    let ctx = own_context(None);
    // STORAGE without COPY_SRC: the copy could not be recorded; it is refused up front.
    let buf = raw_buffer(&ctx, 256, wgpu::BufferUsages::STORAGE);
    let before = ctx.counters();
    match ctx.read_back::<u32>(&buf, 16) {
        Err(Error::InvalidArgument(message)) => assert!(message.contains("COPY_SRC"), "{message}"),
        other => panic!("expected Error::InvalidArgument, got {other:?}"),
    }
    assert_eq!(
        ctx.counters().submissions,
        before.submissions,
        "nothing submitted"
    );
    // The error was the readback's own: nothing is left pending.
    assert_usable(&ctx);
}

#[test]
fn sizes_past_the_limits_are_refused_before_allocating() {
    let ctx = own_context(None);
    let limit = ctx.device.limits().max_storage_buffer_binding_size;
    // `filled` checks the size before building the host vector (which could be gigabytes).
    let elems = usize::try_from(limit / 4 + 1).unwrap();
    match ctx.filled("huge", elems, 0f32) {
        Err(Error::TooLarge {
            bytes, limit: l, ..
        }) => assert!(bytes > l && l == limit, "{bytes} {l}"),
        other => panic!("expected Error::TooLarge, got {other:?}"),
    }
    // A readback whose byte count overflows is an invalid argument, not an overflow panic.
    let small = ctx.upload("small", &[1u32, 2, 3, 4]).unwrap();
    assert!(matches!(
        ctx.read_back::<u64>(&small, usize::MAX),
        Err(Error::InvalidArgument(_))
    ));
    // A buffer past max_buffer_size, created inside a scope: a typed error (wgpu refuses it
    // before allocating anything).
    let max = ctx.device.limits().max_buffer_size;
    let too_big = max.saturating_add(wgpu::COPY_BUFFER_ALIGNMENT);
    if too_big > max {
        let scoped = ctx.scoped("oversized buffer", || {
            raw_buffer(&ctx, too_big, wgpu::BufferUsages::STORAGE)
        });
        match scoped {
            Err(Error::Wgpu { what, .. } | Error::OutOfMemory { what, .. }) => {
                assert!(what.contains("oversized"), "{what}")
            }
            other => panic!("expected a GPU error, got {other:?}"),
        }
    }
    assert_usable(&ctx);
}

#[test]
fn errors_outside_scopes_are_returned_by_the_next_wait_not_panics() {
    let ctx = own_context(None);
    // MAP_READ may only be combined with COPY_DST: a validation error, raised outside any
    // scope. wgpu's default handler would panic here; the context records it instead.
    let _bad = raw_buffer(
        &ctx,
        64,
        wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::STORAGE,
    );
    let _worse = raw_buffer(
        &ctx,
        64,
        wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::UNIFORM,
    );
    match ctx.wait() {
        Err(e @ Error::Wgpu { more: 1, .. }) => {
            let message = e.to_string();
            assert!(message.contains("outside any error scope"), "{message}");
            assert!(message.contains("1 more"), "{message}");
        }
        other => panic!("expected Error::Wgpu from wait, got {other:?}"),
    }
    // Reported once: the context goes on working.
    ctx.wait().unwrap();
    assert_usable(&ctx);

    // The next readback reports it too.
    let _bad = raw_buffer(
        &ctx,
        64,
        wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::STORAGE,
    );
    let buf = ctx.upload("data", &[7u32; 8]).unwrap();
    assert!(matches!(
        ctx.read_back::<u32>(&buf, 8),
        Err(Error::Wgpu { .. })
    ));
    assert_eq!(ctx.read_back::<u32>(&buf, 8).unwrap(), vec![7; 8]);
}

/// A one-layer cache holding one sequence of `len` tokens, and what attending over it needs.
struct Setup {
    cache: PagedKvCache,
    shape: AttentionShape,
    q: Vec<f32>,
}

fn setup(ctx: &Context, len: usize) -> Setup {
    let shape = AttentionShape {
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim_qk: 64,
        head_dim_v: 64,
    };
    let cfg = PagedKvConfig {
        prefix_caching: false,
        ..PagedKvConfig::new(1, 2, 64, KvDtype::F16)
    };
    let mut cache = PagedKvCache::new(ctx, cfg, PoolSize::Blocks(16)).unwrap();
    let mut rng = Rng::new(5);
    cache.add_sequence(0, &[]).unwrap();
    let rows = len * 2 * 64;
    cache
        .append_host(
            ctx,
            0,
            &vec![1; len],
            &[rng.normals(rows, 1.0)],
            &[rng.normals(rows, 1.0)],
        )
        .unwrap();
    let q = rng.normals(4 * 64, 1.0);
    Setup { cache, shape, q }
}

fn attend(ctx: &Context, s: &Setup) -> kvattn::Result<Vec<f32>> {
    let opts = AttentionOptions::default();
    let batch = [PagedQuery { seq: 0, len_q: 1 }];
    let args = PagedAttentionArgs {
        layer: 0,
        batch: &batch,
        shape: s.shape,
        options: &opts,
        precision: Precision::F32,
    };
    paged_attention_host(ctx, &s.cache, &args, &s.q).map(|o| o.out)
}

/// After loss, every kind of call fails with [`Error::DeviceLost`].
fn assert_lost_everywhere(ctx: &Context, s: &mut Setup, buffer: &wgpu::Buffer) {
    let lost = |what: &str, r: kvattn::Result<()>| match r {
        Err(Error::DeviceLost(_)) => {}
        other => panic!("{what} after device loss: expected Error::DeviceLost, got {other:?}"),
    };
    lost("wait", ctx.wait());
    lost("upload", ctx.upload("after loss", &[1f32; 64]).map(drop));
    lost("filled", ctx.filled("after loss", 64, 0u32).map(drop));
    lost("read_back", ctx.read_back::<u32>(buffer, 4).map(drop));
    lost("attention", attend(ctx, s).map(drop));
    let rows = 2 * 64;
    lost(
        "append",
        s.cache
            .append_host(ctx, 0, &[2], &[vec![0.5; rows]], &[vec![0.5; rows]]),
    );
    lost("read_rows", s.cache.read_rows(ctx, 0, 0).map(drop));
    lost(
        "a new cache",
        PagedKvCache::new(
            ctx,
            PagedKvConfig::new(1, 2, 64, KvDtype::F32),
            PoolSize::Blocks(4),
        )
        .map(drop),
    );
    lost("timed", ctx.timed(|| Ok(())).map(drop));
    // The uniform buffer cannot report anything itself; a kernel that binds it does.
    let _ = ctx.uniform("after loss", &[0u32; 4]);
    lost("wait again", ctx.wait());
}

#[test]
fn device_loss_is_a_typed_error_after_a_wait() {
    let ctx = own_context(None);
    let mut s = setup(&ctx, 40);
    let before = attend(&ctx, &s).unwrap();
    assert!(before.iter().all(|x| x.is_finite()));
    let buffer = ctx.upload("kept", &[3u32; 16]).unwrap();
    ctx.device.destroy();
    assert_lost_everywhere(&ctx, &mut s, &buffer);
}

#[test]
fn device_loss_is_noticed_by_the_first_call_that_needs_the_device() {
    // No wait between the loss and the calls: each of these notices it on its own.
    let ctx = own_context(None);
    let s = setup(&ctx, 20);
    ctx.device.destroy();
    assert!(matches!(
        ctx.upload("first after loss", &[1u32; 8]),
        Err(Error::DeviceLost(_))
    ));

    let ctx = own_context(None);
    let s2 = setup(&ctx, 20);
    let buffer = ctx.upload("kept", &[3u32; 16]).unwrap();
    ctx.device.destroy();
    assert!(matches!(
        ctx.read_back::<u32>(&buffer, 16),
        Err(Error::DeviceLost(_))
    ));

    let ctx = own_context(None);
    let s3 = setup(&ctx, 20);
    ctx.device.destroy();
    assert!(matches!(attend(&ctx, &s3), Err(Error::DeviceLost(_))));
    drop((s, s2));
}

#[test]
fn wgpu_errors_keep_wgpus_error_as_their_source() {
    use std::error::Error as _;
    let ctx = own_context(None);
    let data: Vec<u32> = (0..64).collect();
    let a = ctx.upload("a", &data).unwrap();
    let b = ctx.upload("b", &data).unwrap();
    let mut encoder = ctx.encoder("copy past the end");
    encoder.copy_buffer_to_buffer(&a, 0, &b, 8, 256);
    ctx.submit("copy past the end", encoder).unwrap();
    let err = ctx.check_errors().unwrap_err();
    let Error::Wgpu { what, source, more } = &err else {
        panic!("expected Error::Wgpu, got {err:?}");
    };
    assert_eq!((what.as_str(), *more), ("copy past the end", 0));
    assert!(matches!(source, wgpu::Error::Validation { .. }), "{source}");
    // Through the standard trait: the source is the wgpu::Error, and the message names the
    // submission and repeats wgpu's description.
    let wgpu_err = err
        .source()
        .and_then(|s| s.downcast_ref::<wgpu::Error>())
        .expect("the wgpu::Error is the source");
    let shown = err.to_string();
    assert!(shown.contains("copy past the end"), "{shown}");
    assert!(shown.contains(&wgpu_err.to_string()), "{shown}");
    assert_usable(&ctx);

    // Invalid WGSL: the shader error carries the validation error too.
    let err = ctx
        .compile_wgsl(
            "broken",
            "@compute @workgroup_size(1) fn main() { let x: u32 = 1.5; }",
        )
        .unwrap_err();
    assert!(matches!(err, Error::Shader { .. }), "{err}");
    assert!(err
        .source()
        .and_then(|s| s.downcast_ref::<wgpu::Error>())
        .is_some());
}

#[test]
fn snapshot_bytes_that_are_not_safetensors_keep_the_safetensors_error() {
    use std::error::Error as _;
    let ctx = own_context(None);
    let config = PagedKvConfig::new(1, 1, 32, KvDtype::F16);
    let mut cache = PagedKvCache::new(&ctx, config, PoolSize::Blocks(4)).unwrap();
    let err = cache
        .import_snapshot(&ctx, 1, b"definitely not safetensors")
        .unwrap_err();
    assert!(matches!(err, Error::Safetensors { .. }), "{err:?}");
    assert!(err.to_string().starts_with("snapshot: "), "{err}");
    assert!(err
        .source()
        .and_then(|s| s.downcast_ref::<safetensors::SafeTensorError>())
        .is_some());
    // Nothing was created.
    assert!(cache.block_table(1).is_err());
}
