//! Paged attention plans that live across steps: a plan built once for a capacity, updated per
//! step with `queue.write_buffer`, recorded into the caller's compute pass with bindings at
//! offsets in an activation arena. Each step gives the same bits as a fresh plan; a warm step
//! creates no buffer and no bind group and submits once; misuse is a typed error before
//! anything is recorded or written.

use kvattn::attention::paged::{
    AttentionIo, PagedAttentionArgs, PagedAttentionPlan, PagedQuery, PlanCapacity, PlanSpec,
    SPLIT_TOKENS,
};
use kvattn::attention::{AttentionOptions, AttentionShape};
use kvattn::cache::paged::{PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::gpu::{is_unwritten, Context, UNWRITTEN};
use kvattn::quant::KvDtype;
use kvattn::shader::Precision;
use kvattn::Error;

use crate::common::{own_context, Rng};

const LAYERS: usize = 2;

struct Setup {
    shape: AttentionShape,
    cache: PagedKvCache,
    rng: Rng,
}

impl Setup {
    fn new(ctx: &Context, dtype: KvDtype, head_dim: usize, blocks: usize, seed: u64) -> Self {
        let cfg = PagedKvConfig {
            block_size: 4,
            prefix_caching: false,
            model_id: "plan-lifetime".into(),
            ..PagedKvConfig::new(LAYERS, 2, head_dim, dtype)
        };
        Self {
            shape: AttentionShape {
                num_q_heads: 4,
                num_kv_heads: 2,
                head_dim_qk: head_dim,
                head_dim_v: head_dim,
            },
            cache: PagedKvCache::new(ctx, cfg, PoolSize::Blocks(blocks)).unwrap(),
            rng: Rng::new(seed),
        }
    }

    /// Appends `n` tokens of random K/V to `seq` (adding the sequence when new).
    fn grow(&mut self, ctx: &Context, seq: u64, n: usize) {
        if self.cache.allocator().len(seq).is_err() {
            self.cache.add_sequence(seq, &[]).unwrap();
        }
        let d = self.shape.head_dim_qk;
        let rows: Vec<Vec<f32>> = (0..LAYERS)
            .map(|_| self.rng.normals(n * 2 * d, 1.0))
            .collect();
        let tokens: Vec<u32> = (0..n as u32).collect();
        self.cache
            .append_host(ctx, seq, &tokens, &rows, &rows.clone())
            .unwrap();
    }

    fn q(&mut self, tokens: usize) -> Vec<f32> {
        self.rng.normals(
            tokens * self.shape.num_q_heads * self.shape.head_dim_qk,
            1.0,
        )
    }

    fn spec<'a>(&self, opts: &'a AttentionOptions) -> PlanSpec<'a> {
        PlanSpec {
            shape: self.shape,
            options: opts,
            precision: Precision::F32,
            split_tokens: 16,
        }
    }

    /// out and lse bits of a fresh `PagedAttentionPlan::with_split_tokens` + `run` on `layer`.
    fn fresh(
        &self,
        ctx: &Context,
        batch: &[PagedQuery],
        opts: &AttentionOptions,
        layer: usize,
        q: &[f32],
    ) -> (Vec<u32>, Vec<u32>) {
        let args = PagedAttentionArgs {
            layer,
            batch,
            shape: self.shape,
            options: opts,
            precision: Precision::F32,
        };
        let plan = PagedAttentionPlan::with_split_tokens(ctx, &self.cache, &args, 16).unwrap();
        let rows = plan.total_q() * self.shape.num_q_heads;
        let qb = ctx.upload("q", q).unwrap();
        let out = ctx
            .filled("out", rows * self.shape.head_dim_v, UNWRITTEN)
            .unwrap();
        let lse = ctx.filled("lse", rows, UNWRITTEN).unwrap();
        plan.run(ctx, &self.cache, layer, &qb, &out, &lse).unwrap();
        read_bits(ctx, &out, rows * self.shape.head_dim_v, &lse, rows)
    }
}

fn read_bits(
    ctx: &Context,
    out: &wgpu::Buffer,
    out_len: usize,
    lse: &wgpu::Buffer,
    lse_len: usize,
) -> (Vec<u32>, Vec<u32>) {
    let o: Vec<f32> = ctx.read_back(out, out_len).unwrap();
    let l: Vec<f32> = ctx.read_back(lse, lse_len).unwrap();
    assert!(
        !o.iter().chain(&l).any(|&x| is_unwritten(x)),
        "an output was not written"
    );
    (
        o.iter().map(|x| x.to_bits()).collect(),
        l.iter().map(|x| x.to_bits()).collect(),
    )
}

/// Activation buffers sized for `capacity` query tokens.
struct Io {
    q: wgpu::Buffer,
    out: wgpu::Buffer,
    lse: wgpu::Buffer,
}

impl Io {
    fn new(ctx: &Context, shape: &AttentionShape, tokens: usize) -> Self {
        let rows = tokens * shape.num_q_heads;
        Self {
            q: ctx.filled("q", rows * shape.head_dim_qk, 0.0f32).unwrap(),
            out: ctx
                .filled("out", rows * shape.head_dim_v, UNWRITTEN)
                .unwrap(),
            lse: ctx.filled("lse", rows, UNWRITTEN).unwrap(),
        }
    }

    /// Writes the step's queries and re-fills the outputs with the unwritten sentinel.
    fn load(&self, ctx: &Context, q: &[f32]) {
        ctx.write_buffer(&self.q, 0, bytemuck::cast_slice(q))
            .unwrap();
        let fill = vec![UNWRITTEN; (self.out.size() / 4) as usize];
        ctx.write_buffer(&self.out, 0, bytemuck::cast_slice(&fill))
            .unwrap();
        let fill = vec![UNWRITTEN; (self.lse.size() / 4) as usize];
        ctx.write_buffer(&self.lse, 0, bytemuck::cast_slice(&fill))
            .unwrap();
    }

    fn io<'a>(&'a self, cache: &'a PagedKvCache, layer: usize) -> AttentionIo<'a> {
        AttentionIo {
            cache,
            layer,
            q: self.q.as_entire_buffer_binding(),
            out: self.out.as_entire_buffer_binding(),
            lse: self.lse.as_entire_buffer_binding(),
        }
    }
}

/// Step 1 and step 2 (longer sequences, another batch) through one plan made with a capacity:
/// each bit-identical to a fresh plan; the second step creates no buffer and no bind group and
/// is one submission.
fn two_steps(ctx: &Context, dtype: KvDtype, head_dim: usize, blocks: usize, lens: [usize; 3]) {
    let mut s = Setup::new(ctx, dtype, head_dim, blocks, 11);
    let opts = AttentionOptions {
        sliding_window: Some(40),
        ..AttentionOptions::default()
    };
    s.grow(ctx, 0, lens[0]);
    s.grow(ctx, 1, lens[1]);
    let capacity = PlanCapacity {
        max_seqs: 3,
        max_q_tokens: 8,
        max_blocks_per_seq: 64,
    };
    let mut plan =
        PagedAttentionPlan::with_capacity(ctx, &s.cache, &s.spec(&opts), capacity).unwrap();
    assert_eq!(plan.total_q(), 0, "no batch before the first update");
    let io = Io::new(ctx, &s.shape, capacity.max_q_tokens);

    // Step 1: a prefill chunk of 3 and a decode token.
    let step1 = [
        PagedQuery { seq: 0, len_q: 3 },
        PagedQuery { seq: 1, len_q: 1 },
    ];
    let q1 = s.q(4);
    plan.update(ctx, &s.cache, &step1).unwrap();
    io.load(ctx, &q1);
    ctx.run_pass("step 1", |pass| plan.encode(ctx, pass, &io.io(&s.cache, 1)))
        .unwrap();
    let rows1 = 4 * s.shape.num_q_heads;
    let got1 = read_bits(ctx, &io.out, rows1 * head_dim, &io.lse, rows1);
    assert_eq!(got1, s.fresh(ctx, &step1, &opts, 1, &q1), "step 1 bits");

    // Step 2: every sequence longer, a new one, another order and more queries.
    s.grow(ctx, 0, 23);
    s.grow(ctx, 1, 9);
    s.grow(ctx, 2, lens[2]);
    let step2 = [
        PagedQuery { seq: 2, len_q: 5 },
        PagedQuery { seq: 0, len_q: 1 },
        PagedQuery { seq: 1, len_q: 2 },
    ];
    let q2 = s.q(8);
    io.load(ctx, &q2);
    let before = ctx.counters();
    plan.update(ctx, &s.cache, &step2).unwrap();
    ctx.run_pass("step 2", |pass| plan.encode(ctx, pass, &io.io(&s.cache, 1)))
        .unwrap();
    let warm = ctx.counters().since(&before);
    assert_eq!(
        warm.buffers_created, 0,
        "a warm step created buffers: {warm:?}"
    );
    assert_eq!(
        warm.bind_groups_created, 0,
        "a warm step created bind groups: {warm:?}"
    );
    assert_eq!(
        warm.submissions, 1,
        "a warm step is one submission: {warm:?}"
    );
    assert!(
        warm.bytes_uploaded > 0,
        "update wrote no metadata: {warm:?}"
    );
    assert_eq!(plan.total_q(), 8);
    let rows2 = 8 * s.shape.num_q_heads;
    let got2 = read_bits(ctx, &io.out, rows2 * head_dim, &io.lse, rows2);
    assert_eq!(got2, s.fresh(ctx, &step2, &opts, 1, &q2), "step 2 bits");
}

#[test]
fn capacity_plan_steps_match_fresh_plans_and_warm_step_creates_nothing() {
    let ctx = own_context(None);
    two_steps(&ctx, KvDtype::F16, 32, 200, [30, 5, 60]);
}

#[test]
fn capacity_plan_over_split_pools_matches_fresh_plans() {
    // 64-dim f32 rows of 2 KV heads, 4-token blocks: 2 KiB per block, 32 blocks per 64 KiB
    // buffer, so the sequences' blocks cross pool buffers.
    let ctx = own_context(Some(64 << 10));
    let s = Setup::new(&ctx, KvDtype::F32, 64, 100, 1);
    let pools = s.cache.layer(0).unwrap().k.buffers().len();
    assert!(pools > 1, "the capped cache has {pools} pool buffer");
    drop(s);
    two_steps(&ctx, KvDtype::F32, 64, 100, [70, 50, 90]);
}

#[test]
fn second_update_without_submission_is_refused_and_writes_nothing() {
    let ctx = own_context(None);
    let mut s = Setup::new(&ctx, KvDtype::F32, 32, 100, 2);
    let opts = AttentionOptions::default();
    s.grow(&ctx, 0, 20);
    s.grow(&ctx, 1, 7);
    let capacity = PlanCapacity {
        max_seqs: 2,
        max_q_tokens: 4,
        max_blocks_per_seq: 16,
    };
    let mut plan =
        PagedAttentionPlan::with_capacity(&ctx, &s.cache, &s.spec(&opts), capacity).unwrap();
    let io = Io::new(&ctx, &s.shape, 4);
    let step1 = [
        PagedQuery { seq: 0, len_q: 2 },
        PagedQuery { seq: 1, len_q: 1 },
    ];
    let q1 = s.q(3);
    io.load(&ctx, &q1);
    plan.update(&ctx, &s.cache, &step1).unwrap();
    let mut encoder = ctx.encoder("recorded, not yet submitted");
    {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
        plan.encode(&ctx, &mut pass, &io.io(&s.cache, 0)).unwrap();
    }
    // (Nothing submits in between: growing the cache would.)
    let step2 = [PagedQuery { seq: 1, len_q: 4 }];
    let before = ctx.counters();
    let err = plan.update(&ctx, &s.cache, &step2).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("without a submission")),
        "{err}"
    );
    assert_eq!(
        ctx.counters().since(&before).bytes_uploaded,
        0,
        "a refused update wrote metadata"
    );
    assert_eq!(plan.total_q(), 3, "a refused update changed the plan");
    ctx.submit("step 1", encoder).unwrap();
    let rows = 3 * s.shape.num_q_heads;
    let got = read_bits(&ctx, &io.out, rows * 32, &io.lse, rows);
    assert_eq!(got, s.fresh(&ctx, &step1, &opts, 0, &q1), "step 1 bits");
    // After the submission the update goes through.
    plan.update(&ctx, &s.cache, &step2).unwrap();
    assert_eq!(plan.total_q(), 4);
}

#[test]
fn update_over_capacity_names_the_limit() {
    let ctx = crate::common::gpu();
    let mut s = Setup::new(ctx, KvDtype::F32, 32, 100, 3);
    let opts = AttentionOptions::default();
    for (seq, n) in [(0, 6), (1, 6), (2, 6), (3, 30)] {
        s.grow(ctx, seq, n);
    }
    let capacity = PlanCapacity {
        max_seqs: 2,
        max_q_tokens: 4,
        max_blocks_per_seq: 4,
    };
    let mut plan =
        PagedAttentionPlan::with_capacity(ctx, &s.cache, &s.spec(&opts), capacity).unwrap();
    let q = |seq, len_q| PagedQuery { seq, len_q };
    for (batch, limit) in [
        (vec![q(0, 1), q(1, 1), q(2, 1)], "max_seqs"),
        (vec![q(0, 3), q(1, 2)], "max_q_tokens"),
        (vec![q(0, 1), q(3, 1)], "max_blocks_per_seq"),
    ] {
        let err = plan.update(ctx, &s.cache, &batch).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains(limit)),
            "{limit}: {err}"
        );
        assert_eq!(plan.total_q(), 0, "a refused update changed the plan");
    }
    // At the limits the batch fits.
    plan.update(ctx, &s.cache, &[q(0, 2), q(1, 2)]).unwrap();
    assert_eq!(plan.total_q(), 4);
    // A zero capacity is refused up front.
    let zero = PlanCapacity {
        max_q_tokens: 0,
        ..capacity
    };
    let err = PagedAttentionPlan::with_capacity(ctx, &s.cache, &s.spec(&opts), zero).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("max_q_tokens")),
        "{err}"
    );
}

#[test]
fn plan_refuses_another_cache() {
    let ctx = own_context(None);
    let mut a = Setup::new(&ctx, KvDtype::F32, 32, 50, 4);
    let mut b = Setup::new(&ctx, KvDtype::F32, 32, 50, 4);
    a.grow(&ctx, 0, 9);
    b.grow(&ctx, 0, 9);
    let opts = AttentionOptions::default();
    let capacity = PlanCapacity {
        max_seqs: 1,
        max_q_tokens: 1,
        max_blocks_per_seq: 8,
    };
    let batch = [PagedQuery { seq: 0, len_q: 1 }];
    let mut plan =
        PagedAttentionPlan::with_capacity(&ctx, &a.cache, &a.spec(&opts), capacity).unwrap();
    let err = plan.update(&ctx, &b.cache, &batch).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("another cache")),
        "{err}"
    );
    plan.update(&ctx, &a.cache, &batch).unwrap();
    let io = Io::new(&ctx, &a.shape, 1);
    let before = ctx.counters();
    let err = ctx
        .run_pass("wrong cache", |pass| {
            plan.encode(&ctx, pass, &io.io(&b.cache, 0))
        })
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("another cache")),
        "{err}"
    );
    // A plan made by `new` over one cache refuses to run over the other too.
    let args = PagedAttentionArgs {
        layer: 0,
        batch: &batch,
        shape: a.shape,
        options: &opts,
        precision: Precision::F32,
    };
    let fresh = PagedAttentionPlan::new(&ctx, &a.cache, &args).unwrap();
    let err = fresh
        .run(&ctx, &b.cache, 0, &io.q, &io.out, &io.lse)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert_eq!(
        ctx.counters().since(&before).submissions,
        0,
        "a refused encode submitted work"
    );
}

#[test]
fn encode_at_arena_offsets_and_refused_bindings() {
    let ctx = own_context(None);
    let mut s = Setup::new(&ctx, KvDtype::F16, 32, 100, 5);
    let opts = AttentionOptions::default();
    s.grow(&ctx, 0, 25);
    s.grow(&ctx, 1, 13);
    let batch = [
        PagedQuery { seq: 0, len_q: 3 },
        PagedQuery { seq: 1, len_q: 1 },
    ];
    let capacity = PlanCapacity {
        max_seqs: 2,
        max_q_tokens: 4,
        max_blocks_per_seq: 8,
    };
    let mut plan =
        PagedAttentionPlan::with_capacity(&ctx, &s.cache, &s.spec(&opts), capacity).unwrap();
    plan.update(&ctx, &s.cache, &batch).unwrap();
    let q = s.q(4);
    let rows = 4 * s.shape.num_q_heads;
    let (q_len, out_len) = (rows * 32, rows * 32);
    let want = s.fresh(&ctx, &batch, &opts, 0, &q);

    // One arena: [pad | q | pad | out | lse], every part at an aligned offset.
    let align = u64::from(ctx.device.limits().min_storage_buffer_offset_alignment).max(4);
    let up = |bytes: u64| bytes.div_ceil(align) * align;
    let q_at = align;
    let out_at = up(q_at + q_len as u64 * 4) + align;
    let lse_at = up(out_at + out_len as u64 * 4);
    let arena_len = (lse_at / 4) as usize + rows;
    let mut arena = vec![UNWRITTEN; arena_len];
    arena[(q_at / 4) as usize..(q_at / 4) as usize + q_len].copy_from_slice(&q);
    let arena = ctx.upload("arena", &arena).unwrap();
    let binding = |offset: u64, elems: usize| wgpu::BufferBinding {
        buffer: &arena,
        offset,
        size: std::num::NonZeroU64::new(elems as u64 * 4),
    };
    let io = AttentionIo {
        cache: &s.cache,
        layer: 0,
        q: binding(q_at, q_len),
        out: binding(out_at, out_len),
        lse: binding(lse_at, rows),
    };
    ctx.run_pass("arena", |pass| plan.encode(&ctx, pass, &io))
        .unwrap();
    let all: Vec<f32> = ctx.read_back(&arena, arena_len).unwrap();
    let bits = |at: u64, n: usize| -> Vec<u32> {
        all[(at / 4) as usize..(at / 4) as usize + n]
            .iter()
            .map(|x| x.to_bits())
            .collect()
    };
    assert_eq!(bits(out_at, out_len), want.0, "out at an offset");
    assert_eq!(bits(lse_at, rows), want.1, "lse at an offset");
    // The bytes around the outputs are untouched.
    assert!(all[(out_at / 4) as usize - 1..(out_at / 4) as usize]
        .iter()
        .all(|&x| is_unwritten(x)));

    let refused = |io: AttentionIo, what: &str| {
        let before = ctx.counters();
        let err = ctx
            .run_pass("refused", |pass| plan.encode(&ctx, pass, &io))
            .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains(what)),
            "{what}: {err}"
        );
        let after = ctx.counters().since(&before);
        assert_eq!(after.submissions, 0, "{what}: submitted");
    };
    // A misaligned offset.
    let odd = if align > 4 { q_at + 4 } else { q_at + 2 };
    refused(
        AttentionIo {
            q: binding(odd, q_len),
            ..io.clone()
        },
        "alignment",
    );
    // An out binding one row too small, and a whole buffer too small.
    refused(
        AttentionIo {
            out: binding(out_at, out_len - 32),
            ..io.clone()
        },
        "out buffer holds",
    );
    let small = ctx.filled("small out", out_len - 1, UNWRITTEN).unwrap();
    refused(
        AttentionIo {
            out: small.as_entire_buffer_binding(),
            ..io.clone()
        },
        "out buffer holds",
    );
    // A buffer without STORAGE usage.
    let plain = ctx
        .create_buffer(&wgpu::BufferDescriptor {
            label: Some("not storage"),
            size: (rows * 4) as u64,
            usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
        .unwrap();
    refused(
        AttentionIo {
            lse: plain.as_entire_buffer_binding(),
            ..io.clone()
        },
        "STORAGE",
    );
    // out and lse overlapping in the arena.
    refused(
        AttentionIo {
            lse: binding(out_at, rows),
            ..io.clone()
        },
        "overlap",
    );
}

#[test]
fn buffer_of_another_device_is_refused_before_submitting() {
    let ctx = own_context(None);
    let other = own_context(None);
    let mut s = Setup::new(&ctx, KvDtype::F32, 32, 50, 6);
    s.grow(&ctx, 0, 12);
    let opts = AttentionOptions::default();
    let batch = [PagedQuery { seq: 0, len_q: 2 }];
    let args = PagedAttentionArgs {
        layer: 0,
        batch: &batch,
        shape: s.shape,
        options: &opts,
        precision: Precision::F32,
    };
    let plan = PagedAttentionPlan::with_split_tokens(&ctx, &s.cache, &args, SPLIT_TOKENS).unwrap();
    let rows = 2 * s.shape.num_q_heads;
    let mine = Io::new(&ctx, &s.shape, 2);
    let foreign = other.filled("foreign q", rows * 32, 0.5f32).unwrap();
    let before = ctx.counters();
    let err = ctx
        .run_pass("foreign", |pass| {
            plan.encode(
                &ctx,
                pass,
                &AttentionIo {
                    q: foreign.as_entire_buffer_binding(),
                    ..mine.io(&s.cache, 0)
                },
            )
        })
        .unwrap_err();
    assert!(
        matches!(err, Error::Wgpu { .. } | Error::InvalidArgument(_)),
        "{err}"
    );
    assert_eq!(ctx.counters().since(&before).submissions, 0, "submitted");
    // The context is still usable: the same plan with its own buffers runs.
    plan.run(&ctx, &s.cache, 0, &mine.q, &mine.out, &mine.lse)
        .unwrap();
    let out: Vec<f32> = ctx.read_back(&mine.out, rows * 32).unwrap();
    assert!(!out.iter().any(|&x| is_unwritten(x)));
    ctx.check_errors().unwrap();
}

/// The workspace `with_capacity` sizes holds every batch within the capacity: random batches
/// (prefill and decode, windows, tiny splits, pools over several buffers) all update.
#[test]
fn worst_case_workspace_holds_every_batch_within_capacity() {
    let ctx = crate::common::gpu_capped();
    let mut s = Setup::new(ctx, KvDtype::F32, 64, 120, 7);
    let mut rng = Rng::new(8);
    let capacity = PlanCapacity {
        max_seqs: 4,
        max_q_tokens: 12,
        max_blocks_per_seq: 28,
    };
    for seq in 0..6u64 {
        let n = 1 + (rng.next_u64() % 100) as usize;
        s.grow(ctx, seq, n);
    }
    let pools = s.cache.layer(0).unwrap().k.buffers().len();
    assert!(pools > 1, "the capped cache has {pools} pool buffer");
    for (window, split) in [(None, 3), (Some(5), 1), (None, 1000), (Some(50), 7)] {
        let opts = AttentionOptions {
            sliding_window: window,
            ..AttentionOptions::default()
        };
        let spec = PlanSpec {
            split_tokens: split,
            ..s.spec(&opts)
        };
        let mut plan = PagedAttentionPlan::with_capacity(ctx, &s.cache, &spec, capacity).unwrap();
        let mut updated = 0;
        for _ in 0..60 {
            let seqs = 1 + (rng.next_u64() % 4) as usize;
            let mut budget = capacity.max_q_tokens;
            let mut batch = Vec::new();
            for i in 0..seqs {
                let seq = rng.next_u64() % 6;
                if batch.iter().any(|q: &PagedQuery| q.seq == seq) {
                    continue;
                }
                let len_k = s.cache.allocator().len(seq).unwrap();
                let most = len_k.min(budget - (seqs - i - 1).min(budget - 1));
                let len_q = 1 + (rng.next_u64() as usize % most.max(1));
                budget -= len_q;
                batch.push(PagedQuery { seq, len_q });
                if budget == 0 {
                    break;
                }
            }
            plan.update(ctx, &s.cache, &batch)
                .unwrap_or_else(|e| panic!("{batch:?} (window {window:?}, split {split}): {e}"));
            updated += 1;
        }
        assert_eq!(updated, 60);
    }
}

/// `encode_merge_states` and `encode_decode` record into a caller's pass (several ops, one
/// submission) and give the bits of `merge_states` and `decode`.
#[test]
fn merge_states_and_decode_encode_into_one_pass() {
    use kvattn::attention::decode::{decode, encode_decode, DecodeArgs};
    use kvattn::attention::merge_states::{encode_merge_states, merge_states, AttentionState};

    let ctx = own_context(None);
    let mut rng = Rng::new(9);
    let (rows, d) = (12, 32);
    let up = |n: usize, rng: &mut Rng| ctx.upload("state", &rng.normals(n, 1.0)).unwrap();
    let (ao, al, bo, bl) = (
        up(rows * d, &mut rng),
        up(rows, &mut rng),
        up(rows * d, &mut rng),
        up(rows, &mut rng),
    );
    let a = AttentionState { o: &ao, lse: &al };
    let b = AttentionState { o: &bo, lse: &bl };
    let outs = |n: usize| {
        (
            ctx.filled("o", n * d, UNWRITTEN).unwrap(),
            ctx.filled("l", n, UNWRITTEN).unwrap(),
        )
    };
    let (want_o, want_l) = outs(rows);
    merge_states(
        &ctx,
        rows,
        d,
        a,
        b,
        AttentionState {
            o: &want_o,
            lse: &want_l,
        },
    )
    .unwrap();

    // Decode: 3 sequences over contiguous f32 K/V.
    let shape = AttentionShape {
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim_qk: d,
        head_dim_v: d,
    };
    let cu = [0u32, 5, 17, 40];
    let q = up(3 * 4 * d, &mut rng);
    let k = up(40 * 2 * d, &mut rng);
    let v = up(40 * 2 * d, &mut rng);
    let opts = AttentionOptions::default();
    let (dec_want_o, dec_want_l) = outs(3 * 4);
    let base = DecodeArgs {
        shape,
        options: &opts,
        precision: Precision::F32,
        q: &q,
        k: &k,
        v: &v,
        k_dtype: KvDtype::F32,
        v_dtype: KvDtype::F32,
        cu_seqlens_k: &cu,
        out: &dec_want_o,
        lse: &dec_want_l,
    };
    decode(&ctx, &base).unwrap();

    let (got_o, got_l) = outs(rows);
    let (dec_o, dec_l) = outs(3 * 4);
    let before = ctx.counters();
    ctx.run_pass("both", |pass| {
        encode_merge_states(
            &ctx,
            pass,
            rows,
            d,
            a,
            b,
            AttentionState {
                o: &got_o,
                lse: &got_l,
            },
        )?;
        encode_decode(
            &ctx,
            pass,
            &DecodeArgs {
                out: &dec_o,
                lse: &dec_l,
                ..base
            },
        )
    })
    .unwrap();
    assert_eq!(ctx.counters().since(&before).submissions, 1);
    assert_eq!(
        read_bits(&ctx, &got_o, rows * d, &got_l, rows),
        read_bits(&ctx, &want_o, rows * d, &want_l, rows),
        "merge_states"
    );
    assert_eq!(
        read_bits(&ctx, &dec_o, 12 * d, &dec_l, 12),
        read_bits(&ctx, &dec_want_o, 12 * d, &dec_want_l, 12),
        "decode"
    );
    // out sharing a buffer with an input is refused before recording.
    let before = ctx.counters();
    let err = ctx
        .run_pass("aliased", |pass| {
            encode_merge_states(
                &ctx,
                pass,
                rows,
                d,
                a,
                b,
                AttentionState {
                    o: &ao,
                    lse: &got_l,
                },
            )
        })
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert_eq!(ctx.counters().since(&before).submissions, 0);
}
